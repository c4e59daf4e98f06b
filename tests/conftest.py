"""Suite-wide settings.

Hypothesis judges its own speed by the clock: on a loaded two-core runner a slow draw fails the
"too_slow" health check and a slow example the per-example deadline, though nothing is wrong
with the code. Both are off for every property test; pytest-timeout still bounds a hang.
"""

from hypothesis import HealthCheck, settings

settings.register_profile("foundry", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("foundry")
