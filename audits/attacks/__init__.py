"""The attacks of ``fl-secure audit``, each run on what one party of a run saw.

- :mod:`audits.attacks.inversion` -- model inversion of the targets from the view's class
  embeddings (or surrogates), judged by an independent evaluator.
- :mod:`audits.attacks.templates` -- the view's head rows identified as the targets' templates.
- :mod:`audits.attacks.leakage` -- face features recovered from rebuilt client updates and
  from their secure sum.
- :mod:`audits.attacks.canary` -- the empirical epsilon of the run's client-level mechanism.

:mod:`audits.run_audit` runs them on every view and writes ``RUN/audit/results.json``.
"""
