"""Sphinx settings of the course website; `python3 course.py site` stages the sources (this
folder, the chapters' reader copies) and builds build/site/ with them (docs/site/build.py)."""
project = "dpcourse"
author = "the dpcourse authors"
html_title = "Data-parallel training from scratch"
extensions = ["myst_nb", "sphinx.ext.githubpages"]  # githubpages: .nojekyll, so _static/ is served
nb_execution_mode = "off"  # the stored outputs, as committed; nothing runs
nb_merge_streams = True  # one block per cell for stdout written in several pieces
myst_enable_extensions = []  # no dollar math: the chapters have none, and MathJax is a CDN
html_theme = "furo"  # system fonts, no web fonts or CDN; local search; prev/next links
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_copy_source = False  # the notebooks download from notebooks/, student/, solutions/
html_show_sourcelink = False
html_permalinks_icon = "#"
html_show_search_summary = False  # summaries fetch each page: blocked from file://
html_favicon = "_static/favicon.svg"  # a local icon: served, the browser asks for one
