"""Sphinx configuration of the course's website, built by ``python -m course site``
(``course/classroom/site.py`` writes the pages into a staging folder and runs Sphinx with this file).

Sphinx + MyST-NB + the Sphinx Book Theme: every notebook is rendered with the outputs stored in
``solutions/`` (``nb_execution_mode = "off"``: the outputs nbval checks, never re-run here), and
nothing is fetched from the network at build time (the theme's files come with its package).
"""

from course.classroom.notebooks import repository_url

project = "DDP, by running it"
author = "the course's authors"
copyright = "the course's authors (MIT licence)"

extensions = ["myst_nb", "sphinx.ext.autodoc"]
myst_enable_extensions = ["colon_fence"]

# The stored outputs, as nbval compares them; a notebook is never executed by the site's build.
nb_execution_mode = "off"
nb_merge_streams = True  # a launch prints one stream per rank: one output box
# A check's verdict, hint() and solution() have a text/markdown twin of their text/plain: MyST-NB
# prefers it (its default order), so they render as in JupyterLab: code as code, highlighted.

# Broken internal links and cross-references fail the build (site.py runs Sphinx with -W -n). The
# API's signatures name torch's and Python's types, which are not documented here: only references
# to the course itself must resolve.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!course\b).*")]
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
# Defaults as written in the source (``environ=os.environ``), not their values: a value such as the
# build machine's environment must never be printed into a public page.
autodoc_preserve_defaults = True
suppress_warnings = ["myst.header"]  # outputs and docstrings start at their own heading levels

html_theme = "sphinx_book_theme"
html_title = project
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_theme_options = {
    "repository_url": repository_url(),  # pyproject.toml's [project.urls] Repository, as the badges
    "use_repository_button": True,
    "use_download_button": False,  # it would download the solution notebook: chapters link the student's
    "use_fullscreen_button": False,
    "show_toc_level": 2,
}
html_last_updated_fmt = None
html_copy_source = False  # the sources are the solutions: the site shows them, but not as downloads
html_show_sourcelink = False

autodoc_inherit_docstrings = False  # torch's autograd.Function docstrings point at torch's own pages


def setup(app):
    from course.classroom.site import literal_blocks

    def docstring(app, what, name, obj, options, lines):
        lines[:] = literal_blocks(lines)

    app.connect("autodoc-process-docstring", docstring)
