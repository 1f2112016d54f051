"""Command line of fl-secure: ``fl-secure {train,server,client,certs,privacy,report,eval,...}``.

It sits in the application layer (:mod:`fl_secure.app`), above ``server``, ``client`` and
``audits``. :mod:`~fl_secure.app.cli.console` builds the parser from one module per
sub-command family and runs the command; ``python -m fl_secure.app.cli`` runs it too.

The sub-command modules import the layers below (``server``, ``client``, ``audits``,
``privacy``'s accountants, torch) inside their command functions, on purpose: ``fl-secure
--help`` then imports none of them and answers in a fraction of a second
(``tests/fl_secure/app/cli/test_console.py`` checks that no torch module is loaded).
"""

from fl_secure.app.cli.console import build_parser, main

__all__ = ["build_parser", "main"]
