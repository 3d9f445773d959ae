"""Hypothesis profiles. `ci` is what the README's command and CI run: derandomized, so a run is reproducible
and a change cannot fail on a draw it did not cause. `dev` (`--hypothesis-profile dev`, the fast tier)
draws a tenth as many examples, at random. A failure found is kept as an @example of its test."""

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True, database=None)
settings.register_profile(
    "dev", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("ci")


def examples(ci: int) -> int:
    """max_examples of a test that draws `ci` examples under the ci profile: a tenth of them under dev."""
    return ci if settings.get_current_profile_name() == "ci" else max(1, ci // 10)
