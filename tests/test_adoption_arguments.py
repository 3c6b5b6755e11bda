"""The `from_pretrained` arguments a diffusers user pastes are honoured, accepted or refused with
one catchable error (HostWeightUsageError, both a HostWeightError and a ValueError) that names the argument."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime import HostWeightError, HostWeightUsageError
from host_weight_runtime.diffusion import ComponentLoadPath, load_component, prewarm_component
from host_weight_runtime.failures import FailureCode, ResolutionStage
from host_weight_runtime.outcomes import PostLoadPublicationStatus, ResolutionOutcome

from ._adoption import (
    SUBFOLDER,
    artifact_keys,
    canonical,
    forward,
    isolate_environment,
    readme_script,
    run_fresh,
    save_variant_folder,
)
from ._diffusion import runtime_at

README_VARIANT_MODEL = '"stabilityai/stable-diffusion-xl-base-1.0"'
SECRET = "hf_doNotStoreThisTokenAnywhere0123456789"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_environment(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Default FP32 weights next to an FP16 variant, as many hub repos ship them."""
    return save_variant_folder(tmp_path_factory.mktemp("models") / "both", seed=31)


@pytest.fixture(scope="module")
def fp16_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_variant_folder(tmp_path_factory.mktemp("models") / "fp16-only", seed=32, default=False)


def _refused(raised: pytest.ExceptionInfo[Any], argument: str) -> HostWeightUsageError:
    """The one error type: a HostWeightUsageError, so both a HostWeightError and a ValueError, naming `argument`."""
    error = raised.value
    assert isinstance(error, HostWeightUsageError)
    assert isinstance(error, HostWeightError) and isinstance(error, ValueError)
    assert error.failure.stage is ResolutionStage.CONFIGURATION
    assert error.failure.details.to_value() == {"argument": argument}
    assert argument in error.failure.message
    return error


# ----------------------------------------------------------------------------- variant


def test_readme_arguments_example_runs_as_written(tmp_path: Path) -> None:
    """D14 (variant): the README's pasted-from_pretrained block, run as written in two fresh processes against a
    folder with an fp16 variant in `unet`: canonical_fallback (published), then local_hit."""
    folder = save_variant_folder(tmp_path / "sdxl", seed=33, subfolder="unet")
    script = readme_script(tmp_path, 'variant="fp16"', README_VARIANT_MODEL, folder)
    root = tmp_path / "domain"

    assert run_fresh(script, root).stdout.split() == ["canonical_fallback", "canonical"]
    assert len(artifact_keys(root)) == 1
    assert run_fresh(script, root).stdout.split() == ["local_hit", "artifact"]


def test_a_variant_loads_its_own_files_into_its_own_artifact(tmp_path: Path, both: Path) -> None:
    """D14 (variant): variant='fp16' gives what from_pretrained(variant='fp16') gives, on the miss and on the hit;
    the variant is different source files, so it is a different artifact from the default weights."""
    runtime = runtime_at(tmp_path / "domain")
    expected = forward(canonical(both / SUBFOLDER, variant="fp16"))
    default_expected = forward(canonical(both / SUBFOLDER))
    assert not torch.equal(expected, default_expected), "the fixture's variant must differ from its default"

    with load_component(
        both, subfolder=SUBFOLDER, variant="fp16", runtime=runtime, publish_in_background=False
    ) as first:
        assert first.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert first.publication is not None and first.publication.status is PostLoadPublicationStatus.PUBLISHED
        assert torch.equal(forward(first.model), expected)
    with load_component(both, subfolder=SUBFOLDER, variant="fp16", runtime=runtime, publish_in_background=False) as hit:
        assert hit.outcome is ResolutionOutcome.LOCAL_HIT and hit.load_path is ComponentLoadPath.ARTIFACT
        assert torch.equal(forward(hit.model), expected)
    with load_component(both, subfolder=SUBFOLDER, runtime=runtime, publish_in_background=False) as plain:
        assert plain.outcome is ResolutionOutcome.CANONICAL_FALLBACK, "the default weights are another artifact"
        assert torch.equal(forward(plain.model), default_expected)
    assert first.identity_key != plain.identity_key
    assert sorted([first.identity_key, plain.identity_key]) == artifact_keys(tmp_path / "domain")


def test_a_variant_only_folder_names_the_variant_to_pass(tmp_path: Path, fp16_only: Path) -> None:
    """A folder holding only *.fp16.safetensors: load_component and prewarm_component without a variant refuse
    with a message naming the variant file and variant="fp16"; nothing is created; with it both work."""
    root = tmp_path / "domain"
    for call in (load_component, prewarm_component):
        with pytest.raises(HostWeightUsageError) as raised:
            call(fp16_only, subfolder=SUBFOLDER, runtime=runtime_at(root))
        message = raised.value.failure.message
        assert "diffusion_pytorch_model.fp16.safetensors" in message
        assert 'variant="fp16"' in message
    assert not root.exists()

    result = prewarm_component(fp16_only, subfolder=SUBFOLDER, variant="fp16", runtime=runtime_at(root))
    with load_component(fp16_only, subfolder=SUBFOLDER, variant="fp16", runtime=runtime_at(root)) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
        assert loaded.identity_key == result.identity_key
        assert torch.equal(forward(loaded.model), forward(canonical(fp16_only / SUBFOLDER, variant="fp16")))


def test_a_variant_that_is_not_there_says_so(tmp_path: Path, both: Path) -> None:
    """variant='bf16' where only fp16 and default files exist: refused, naming the files that are there."""
    with pytest.raises(HostWeightUsageError) as raised:
        load_component(both, subfolder=SUBFOLDER, variant="bf16", runtime=runtime_at(tmp_path / "domain"))
    assert "diffusion_pytorch_model.bf16.safetensors" in raised.value.failure.message
    assert 'variant="fp16"' in raised.value.failure.message


# ----------------------------------------------------------------------------- dtypes and harmless arguments


@pytest.mark.parametrize(
    "dtype_arguments",
    [{"torch_dtype": "bfloat16"}, {"torch_dtype": "torch.bfloat16"}, {"dtype": torch.bfloat16}],
    ids=["bfloat16", "torch.bfloat16", "dtype"],
)
def test_a_pasted_from_pretrained_call_runs_unchanged(
    tmp_path: Path, both: Path, dtype_arguments: dict[str, Any]
) -> None:
    """D14: BF16 by name and every harmless from_pretrained argument (use_safetensors, low_cpu_mem_usage,
    local_files_only, device_map='cpu', token, proxies, output_loading_info=False, ...) load the same model into
    the same artifact as the plain call: miss then hit, both equal to from_pretrained."""
    runtime = runtime_at(tmp_path / "domain")
    expected = forward(canonical(both / SUBFOLDER))
    pasted: dict[str, Any] = {
        "use_safetensors": True,
        "low_cpu_mem_usage": True,
        "local_files_only": True,
        "device_map": "cpu",
        "token": None,
        "proxies": {"https": "http://proxy.invalid:3128"},
        "output_loading_info": False,
        "force_download": False,
        "ignore_mismatched_sizes": False,
        "disable_mmap": False,
        **dtype_arguments,
    }
    with load_component(both, subfolder=SUBFOLDER, runtime=runtime, **pasted, publish_in_background=False) as first:
        assert first.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert torch.equal(forward(first.model), expected)
    with load_component(both, subfolder=SUBFOLDER, runtime=runtime, publish_in_background=False) as plain:
        assert plain.outcome is ResolutionOutcome.LOCAL_HIT and plain.identity_key == first.identity_key
    with load_component(both, subfolder=SUBFOLDER, runtime=runtime, **pasted, publish_in_background=False) as hit:
        assert hit.outcome is ResolutionOutcome.LOCAL_HIT
        assert torch.equal(forward(hit.model), expected)


@pytest.mark.parametrize(
    "device_map", ["cpu", torch.device("cpu"), {"": "cpu"}, {"": torch.device("cpu")}, None], ids=repr
)
def test_device_map_on_the_cpu_is_accepted(tmp_path: Path, both: Path, device_map: object) -> None:
    """Every spelling of 'all on the CPU' is what load_component returns anyway."""
    with load_component(both, subfolder=SUBFOLDER, runtime=runtime_at(tmp_path / "d"), device_map=device_map) as got:
        assert {parameter.device.type for parameter in got.model.parameters()} == {"cpu"}


def test_safetensors_choice_follows_diffusers(tmp_path: Path) -> None:
    """use_safetensors=True on a .bin-only folder is refused (as diffusers does); use_safetensors=False loads the
    .bin checkpoint, publishes it after load, and then hits it."""
    folder = save_variant_folder(tmp_path / "bin-only", seed=34, variants=(), safetensors=False)
    runtime = runtime_at(tmp_path / "domain")
    with pytest.raises(HostWeightUsageError) as raised:
        load_component(folder, subfolder=SUBFOLDER, use_safetensors=True, runtime=runtime)
    assert "diffusion_pytorch_model.safetensors" in raised.value.failure.message
    expected = forward(canonical(folder / SUBFOLDER, use_safetensors=False))
    for outcome in (ResolutionOutcome.CANONICAL_FALLBACK, ResolutionOutcome.LOCAL_HIT):
        with load_component(folder, subfolder=SUBFOLDER, use_safetensors=False, runtime=runtime) as loaded:
            assert loaded.outcome is outcome
            assert torch.equal(forward(loaded.model), expected)


def test_the_token_is_never_kept_or_logged(tmp_path: Path, both: Path, caplog: pytest.LogCaptureFixture) -> None:
    """token= is accepted (nothing is downloaded) and appears in no log record, report, or file of the domain."""
    root = tmp_path / "domain"
    caplog.set_level(logging.DEBUG)
    for _ in range(2):
        with load_component(both, subfolder=SUBFOLDER, token=SECRET, runtime=runtime_at(root)) as loaded:
            assert SECRET not in repr(loaded.summary())
            assert SECRET not in repr(loaded.resolution.to_dict())
    assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
    assert SECRET not in caplog.text
    written = [path for path in root.rglob("*") if path.is_file()]
    assert written
    assert not [path for path in written if SECRET.encode() in path.read_bytes()]


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("arguments", "argument", "code"),
    [
        ({"torch_dtype": "auto"}, "torch_dtype", FailureCode.UNSUPPORTED),
        ({"torch_dtype": torch.float64}, "torch_dtype", FailureCode.UNSUPPORTED),
        ({"dtype": "float8_e4m3fn"}, "dtype", FailureCode.UNSUPPORTED),
        ({"device_map": "cuda"}, "device_map", FailureCode.UNSUPPORTED),
        ({"device_map": "auto"}, "device_map", FailureCode.UNSUPPORTED),
        ({"output_loading_info": True}, "output_loading_info", FailureCode.UNSUPPORTED),
        ({"max_memory": {0: "10GiB"}}, "max_memory", FailureCode.UNSUPPORTED),
        ({"force_download": True}, "force_download", FailureCode.UNSUPPORTED),
        ({"variant": "../fp16"}, "variant", FailureCode.INVALID_CONFIGURATION),
        ({"use_safetensors": "yes"}, "use_safetensors", FailureCode.INVALID_CONFIGURATION),
        ({"torch_dtyp": torch.bfloat16}, "torch_dtyp", FailureCode.INVALID_CONFIGURATION),
        ({"from_tf": True}, "from_tf", FailureCode.INVALID_CONFIGURATION),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_what_cannot_be_honoured_is_one_catchable_error_naming_the_argument(
    tmp_path: Path, both: Path, arguments: dict[str, Any], argument: str, code: FailureCode
) -> None:
    """Each is refused before anything is touched, as a HostWeightUsageError (caught by `except ValueError` and by
    `except HostWeightError`) whose message names the argument and says what to do."""
    root = tmp_path / "domain"
    with pytest.raises(ValueError) as raised:
        load_component(both, subfolder=SUBFOLDER, runtime=runtime_at(root), **arguments)
    error = _refused(raised, argument)
    assert error.code is code
    assert not root.exists()


def test_a_misspelled_argument_gets_a_suggestion(tmp_path: Path, both: Path) -> None:
    with pytest.raises(HostWeightError) as raised:
        load_component(both, subfolder=SUBFOLDER, runtime=runtime_at(tmp_path / "d"), torch_dtyp=torch.bfloat16)
    assert "did you mean 'torch_dtype'?" in _refused(raised, "torch_dtyp").failure.message


def test_a_folder_problem_is_the_same_family(tmp_path: Path, both: Path) -> None:
    """A pipeline folder without subfolder (no config.json) is a HostWeightUsageError too, so one except clause
    covers arguments and folders."""
    with pytest.raises(HostWeightUsageError) as raised:
        load_component(both, runtime=runtime_at(tmp_path / "domain"))
    assert "config.json" in raised.value.failure.message
    assert raised.value.code is FailureCode.INVALID_CONFIGURATION


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_usage_error_pickles_as_itself(protocol: int, tmp_path: Path, both: Path) -> None:
    """A usage error sent between processes stays a HostWeightUsageError with an equal failure."""
    with pytest.raises(HostWeightUsageError) as raised:
        load_component(both, subfolder=SUBFOLDER, runtime=runtime_at(tmp_path / "d"), device_map="cuda:0")
    again = pickle.loads(pickle.dumps(raised.value, protocol=protocol))
    assert type(again) is HostWeightUsageError
    assert again.failure == raised.value.failure
    assert str(again) == str(raised.value)


def test_prewarm_and_load_component_agree_on_the_variant_key(tmp_path: Path, both: Path) -> None:
    """D14 (variant): prewarm_component(variant='fp16') builds the artifact load_component(variant='fp16') hits;
    the default weights are a different key."""
    root = tmp_path / "domain"
    prewarmed = prewarm_component(both, subfolder=SUBFOLDER, variant="fp16", runtime=runtime_at(root))
    with load_component(both, subfolder=SUBFOLDER, variant="fp16", runtime=runtime_at(root)) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
        assert loaded.identity_key == prewarmed.identity_key
    plain = prewarm_component(both, subfolder=SUBFOLDER, runtime=runtime_at(root))
    assert plain.identity_key != prewarmed.identity_key
