"""Schema-level fuzzing: requests generated from the OpenAPI schema, fitting it and not, never get a 5xx,
and every response matches what the schema documents (status code, content type, body)."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from mnv3.config import ServerConfig
from mnv3.server import create_app

pytestmark = pytest.mark.integration

EXAMPLES = 100  # per generation mode, spread over all operations: about a second each


@pytest.fixture(scope="module")
def api_schema(fp32_model_path):
    # Schemathesis runs the app's lifespan itself (model load, warm-up) and keeps it for the process.
    # (schemathesis.pytest.from_fixture does not work with pytest 9, hence a strategy inside a test.)
    app = create_app(
        ServerConfig(
            model=fp32_model_path,
            max_batch_size=4,
            batch_window_ms=5,
            cache_size=16,
            max_upload_bytes=100_000,
            max_pixels=1_000_000,
        )
    )
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors_and_responses_match_the_schema(api_schema, mode):
    @given(case=api_schema.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case):
        # Excluded: "schema-valid data is accepted". The schema says "a binary file"; it cannot say "that
        # decodes as an image", so random bytes rightly get a (documented) 400.
        case.call_and_validate(excluded_checks=[positive_data_acceptance])

    fuzz()
