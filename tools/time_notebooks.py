"""Time chapters top to bottom without changing them, as on a lent GPU host (docs/gpu-runs.md).

`OUT=folder python3 tools/time_notebooks.py SECONDS 08_performance.ipynb ...` runs each
notebook of notebooks/ in a fresh kernel, starts none with under a minute of SECONDS left,
writes the executed copy to OUT and prints one RESULT line per notebook. Run it with
`PYTHONFAULTHANDLER=1` and stderr kept: a kernel's own stderr goes there.
"""
import os
import sys
import time
import traceback
from pathlib import Path

import nbformat
from nbclient import NotebookClient

out = Path(os.environ["OUT"])
deadline = time.monotonic() + float(sys.argv[1])
for name in sys.argv[2:]:
    left = deadline - time.monotonic()
    if left < 60:
        print(f"RESULT {name}: not started, {left:.0f} s left", flush=True)
        continue
    path = Path("notebooks") / name
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    try:
        NotebookClient(nb, timeout=int(left), kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        result = "ok"
    except Exception as error:  # any failure is the result to report
        traceback.print_exc()
        result = f"failed: {type(error).__name__}"
    nbformat.write(nb, out / name)
    print(f"RESULT {name}: {time.perf_counter() - start:.1f} s {result}", flush=True)
