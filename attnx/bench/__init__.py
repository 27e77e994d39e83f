"""``python -m attnx bench``: attnx against PyTorch and a tutorial's NumPy code.

The modules, each importing only those above it (no import circle):

* :mod:`.rows`: what a measured row is (a dict, as ``--json`` prints it),
  reading saved rows back, :class:`~.rows.MissingExtra`.
* :mod:`.cases`: the benchmark's cases, as data: which measurement, with which
  arguments, in which order (``--quick``: fewer and smaller).
* :mod:`.context`: the settings of one run and the timer every row uses
  (interleaved, medians), the measured FMA peak and the read roofline.
* :mod:`.speed`, :mod:`.memory`, :mod:`.models`: the measurements, one
  function per kind of row.
* :mod:`.report`: the rows printed as tables (one per kind) or JSON lines.
* :mod:`.runner`: the cases run in order through the measurements.
* :mod:`.plot`: ``--plot DIR``, the rows drawn as figures (matplotlib).
* :mod:`.cli`: the ``bench`` command's options and its entry point.
* :mod:`.markdown`: the docs' tables, generated from saved ``--json`` output
  (``python -m attnx.bench.markdown README.md docs/performance.md``).

Nothing is imported here: each user imports the module it needs.
"""
