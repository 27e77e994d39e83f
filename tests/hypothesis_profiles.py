"""Hypothesis profiles for the property tests (imported by tests/test_properties.py).

* ``ci`` (the default): derandomised, so every CI run tries the same examples
  and a failure reproduces exactly; a modest number of examples; no deadline
  (the machines are shared and a slow example is not a bug).
* ``dev``: random, many more examples, for a longer hunt on a workstation:

      HYPOTHESIS_PROFILE=dev python -m pytest tests/test_properties.py

  Failures found this way are stored in ``.hypothesis/`` and replayed first
  on the next run; add the minimal example hypothesis prints as an
  ``@example`` (or a plain test) to keep it in CI.

``HYPOTHESIS_PROFILE`` selects the profile; ``HYPOTHESIS_MAX_EXAMPLES``
overrides the profile's number of examples.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SUPPRESS = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    # the ``isa`` fixture selects the kernels once for all the examples of a
    # test: sharing it between examples is what is wanted
    HealthCheck.function_scoped_fixture,
]

settings.register_profile(
    "ci", derandomize=True, max_examples=100, deadline=None, print_blob=True,
    suppress_health_check=_SUPPRESS, database=None)
settings.register_profile(
    "dev", max_examples=3000, deadline=None, print_blob=True,
    suppress_health_check=_SUPPRESS)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
if os.environ.get("HYPOTHESIS_MAX_EXAMPLES"):
    settings.register_profile(
        PROFILE + "-n", settings.get_profile(PROFILE),
        max_examples=int(os.environ["HYPOTHESIS_MAX_EXAMPLES"]))
    settings.load_profile(PROFILE + "-n")
