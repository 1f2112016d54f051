"""The application layer: command line, simulation, experiments, evaluation runs, reports.

It sits on top of every other layer (``fl_secure`` core < ``privacy`` < ``server`` | ``client``
< ``audits`` < ``fl_secure.app``) and nothing below imports it; ``.ci/run`` checks this with
import-linter (``[tool.importlinter]`` in ``pyproject.toml``).
"""
