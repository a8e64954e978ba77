"""nbconvert preprocessor for the slide decks: drop the lines meant for the tools, as the website's
pages do (nbgrader's solution markers, nbval's `# NBVAL_CHECK_OUTPUT`)."""
from nbconvert.preprocessors import Preprocessor

MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")
TOOL_LINES = (*MARKERS, "# NBVAL_CHECK_OUTPUT")


def reader_source(source: str) -> str:
    """A code cell's source without the lines for the tools (and the blank lines they lead)."""
    lines = [line for line in source.split("\n") if line.strip() not in TOOL_LINES]
    while lines and not lines[0].strip():
        lines.pop(0)
    return "\n".join(lines)


class StripToolLines(Preprocessor):
    """Remove the tools' lines (and the blank lines they leave at the top) from code cells."""

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code":
            cell.source = reader_source(cell.source)
        return cell, resources
