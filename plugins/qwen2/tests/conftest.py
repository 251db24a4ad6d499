import os

from hypothesis import HealthCheck, settings

# the same profiles as lensadapters' own tests: HYPOTHESIS_PROFILE=dev (default) | ci | thorough
# ci: derandomized, so a CI run checks the same examples as every other (reproducible, no flaky reds);
# dev and thorough draw new examples on every run to keep exploring
settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
