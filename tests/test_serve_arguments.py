"""The serving example checks its arguments at start-up: a fixed pipeline-call argument that every request
also sets (or that the pipeline's __call__ does not take) stops the service with one line, instead of
making every /predict answer 500."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

from ._serve_support import SERVE_EXAMPLE


@pytest.fixture(scope="module")
def serve_app() -> ModuleType:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(SERVE_EXAMPLE))
        return importlib.import_module("serve_app")


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pipeline folder as far as start-up reads it: its model_index.json names FluxPipeline."""
    folder = tmp_path_factory.mktemp("serve-args") / "flux"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    return folder


@pytest.mark.parametrize(
    ("call_arg", "said"),
    [
        ("num_inference_steps=2", "each request's 'steps' field sets it"),
        ("height=512", "each request's 'height' field sets it"),
        ("width=512", "each request's 'width' field sets it"),
        ('output_type="pil"', "the service sets it"),
        ("max_sequence_length=tokens", "must be JSON"),
        ("num_inference_stepz=2", "takes no argument 'num_inference_stepz'"),
    ],
)
def test_a_call_arg_that_would_break_every_request_stops_the_start(
    serve_app: ModuleType, flux: Path, call_arg: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --call-arg that clashes with a per-request argument, is not JSON, or names no argument of the pipeline's
    __call__ exits 2 at start with one line saying which and what to do."""
    with pytest.raises(SystemExit) as stopped:
        serve_app._parse(["--model", str(flux), f"--call-arg={call_arg}"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert said in err and call_arg.partition("=")[0] in err and "Traceback" not in err


def test_a_valid_call_arg_and_revision_are_kept(serve_app: ModuleType, flux: Path) -> None:
    """A --call-arg the pipeline takes and no request sets is parsed from JSON and kept, with --revision."""
    args = serve_app._parse(["--model", str(flux), "--call-arg=max_sequence_length=32", "--revision", "main"])
    assert args.call_kwargs == {"max_sequence_length": 32} and args.revision == "main"
