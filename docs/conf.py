"""Sphinx configuration of the reliable_jobs documentation (Markdown pages through MyST).

Built by scripts/test and tests/test_docs.py with ``sphinx-build -W --keep-going -b html
docs OUT``: a warning (a broken cross-reference, a page left out of every toctree, a
code block Pygments cannot read) fails the build.
"""

from __future__ import annotations

project = "reliable_jobs"
author = "reliable_jobs authors"
copyright = "reliable_jobs authors"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# Not pages: the Sphinx configuration itself and the build's output.
exclude_patterns = ["_build"]

# Headings up to level 3 get anchors, so [text](page.md#a-heading) links resolve.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = "reliable_jobs"
# No source links: the package has no public home yet (see setup.cfg).
html_show_sourcelink = False
html_copy_source = False
