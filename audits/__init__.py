"""Attack audits: what each party could reconstruct of the sites' faces, and empirical epsilon.

Transport-free core; functions take tensors and models, not run directories.

- :mod:`audits.inversion` -- DeepInversion (Yin et al., CVPR 2020) on a cosine/margin head,
  with BatchNorm-statistics and public-face priors, and surrogate targets.
- :mod:`audits.leakage` -- analytic recovery of a fully connected layer's inputs from its
  update (Phong et al. 2018; Geiping et al. 2020), identification against a gallery, identity
  templates of a shared head.
- :mod:`audits.judge` -- independent evaluator network scoring reconstructions (top-1/top-5
  beside chance, KNN feature distance, SSIM, PSNR).
- :mod:`audits.image_metrics` -- SSIM (Wang et al., IEEE TIP 2004) and PSNR.
- :mod:`audits.canary` -- empirical epsilon lower bounds: Clopper-Pearson over trials
  (Jagielski et al. 2020) and one-run auditing (Steinke, Nasr & Jagielski 2023).
- :mod:`audits.grids` -- PNG grids of real images beside reconstructions.

Wired to run directories (``fl-secure audit``):

- :mod:`audits.observations` -- what the server and a curious client saw, by design and setting.
- :mod:`audits.targets` -- the target identities and the auditor's images of them.
- :mod:`audits.attacks` -- each attack (inversion, templates, leakage, canary) on one view.
- :mod:`audits.mechanism` -- the run's client-level aggregation, as its summary states it.
- :mod:`audits.canary_release` -- that aggregation released on worst-case canaries.
- :mod:`audits.mechanism_audit` -- empirical epsilon of the mechanism, and the audit's size.
- :mod:`audits.run_audit` -- every attack on those views; ``RUN/audit/results.json``, grids
  and findings.
- :mod:`audits.results` -- reading ``results.json`` back: its check, rows per view, tables.
"""
