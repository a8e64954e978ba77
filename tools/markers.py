"""nbconvert preprocessor for the rendered chapters: drop the lines that mark a student's part."""
from nbconvert.preprocessors import Preprocessor

MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")


class StripSolutionMarkers(Preprocessor):
    """Remove nbgrader's `### BEGIN SOLUTION` / `### END SOLUTION` lines from code cells."""

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code":
            cell.source = "\n".join(line for line in cell.source.split("\n")
                                    if line.strip() not in MARKERS)
        return cell, resources
