from click.testing import CliRunner

import dsocr_workers
from dsocr_workers import errors
from dsocr_workers.cli import main


def test_error_tree_exit_codes():
    assert issubclass(errors.CheckpointError, errors.InputError)
    assert {errors.InputError.exit_code, errors.TransientError.exit_code, errors.FailuresError.exit_code} == {
        2,
        3,
        4,
    }


def test_cli_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert dsocr_workers.__version__ in result.output


def test_engine_public_api():
    import dsocr_workers.engine as engine

    assert engine.__all__ == ["DecodeOptions", "DeepSeekOCRSession", "InferenceResult", "ModelSource", "StageTimings"]
    assert all(getattr(engine, name) is not None for name in engine.__all__)
    assert engine.DeepSeekOCRSession.from_local is not None
