"""Execute notebooks in place, top to bottom, the way they are committed.

`python3 course.py execute notebooks/03_*.ipynb solutions/03_*.ipynb`: each notebook runs in a
fresh kernel from its own folder; consecutive stream outputs are merged and progress-bar
redraws (text before a carriage return) dropped, so a tqdm bar is stored as its final line;
the line ends of shell commands (`!cmd` output comes through a terminal: CR LF) become LF.
"""
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbconvert.preprocessors import CoalesceStreamsPreprocessor


def execute(path: Path, timeout: int = 600) -> float:
    """Run the notebook at path in place; returns the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - start
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                output.text = output.text.replace("\r\n", "\n")
    CoalesceStreamsPreprocessor().preprocess(nb, {})
    nbformat.write(nb, path)
    return seconds


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python3 course.py execute NOTEBOOK.ipynb [...]")
    for name in sys.argv[1:]:
        print(f"{name}: {execute(Path(name)):.1f} s", flush=True)
