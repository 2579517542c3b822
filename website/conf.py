"""Sphinx configuration of the course's static site (`scripts/build_site.sh`; `website/build.py` writes the pages
into a folder of its own and runs Sphinx there with this file). Everything it needs comes from PyPI with the
`site` extra: nothing is fetched while building or reading the site (no CDN for widgets or math)."""

project = "DDP Lessons"
author = "DDP Lessons"
copyright = "DDP Lessons"
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
html_theme = "furo"
html_title = "DDP Lessons"
html_static_path = ["_static"]
html_css_files = ["course.css"]
# The notebooks come executed (by the suite's browser test, or by build.py): Sphinx renders, never runs them.
nb_execution_mode = "off"
# Widgets are replaced by build.py (the quiz by its questions, others by a note): no widget JavaScript from a CDN.
nb_ipywidgets_js = {}
# Math would need MathJax from a CDN (Sphinx adds it only to a page with math): the course writes none, and the
# site's browser test fails on any request that leaves the machine.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]
exclude_patterns = ["_build"]
html_favicon = "_static/favicon.png"  # a browser asks for one: without it, every page logs a 404
