"""Numbers that one chapter compares with another's come from runs under the same conditions:
chapter 05's train(1) is chapter 02's baseline through the data-parallel code path, and says it
reproduces that baseline, so the two chapters' stored losses and accuracies must be the same."""
import json
import re
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def printed(name: str) -> str:
    """Everything the stored notebook printed."""
    cells = json.loads((NOTEBOOKS / name).read_text())["cells"]
    return "".join("".join(output.get("text", "")) for cell in cells if cell["cell_type"] == "code"
                   for output in cell["outputs"] if output["output_type"] == "stream")


def test_chapter_05s_one_device_run_stored_chapter_02s_baseline() -> None:
    baseline = re.findall(r"epoch \d+: train loss ([\d.]+), test acc ([\d.]+)",
                          printed("02_lenet_one_device.ipynb"))
    one_device = re.search(r"1 device\(s\): train loss per epoch \[([^\]]*)\], test acc "
                           r"\[([^\]]*)\]", printed("05_training_on_k_devices.ipynb"))
    assert baseline and one_device, "a chapter no longer prints its per-epoch numbers"
    losses, accuracies = ([float(x) for x in group.split(",")] for group in one_device.groups())
    assert losses == [float(loss) for loss, _ in baseline], "train loss per epoch, 05 vs 02"
    assert accuracies == [float(acc) for _, acc in baseline], "test accuracy per epoch, 05 vs 02"
