"""The model families, one line each (`FAMILIES`), and what picks one: a preset's name or a checkpoint
directory's `config.json`.

A family is a package beside this module (model/<package>/) with a torch-free `config.py` (`PRESETS`,
`MODES`, `DEFAULT_MODE`, `MAX_CROPS`, `matches(config_json) -> layout | None`, a config class with
`from_<layout>(config_json)` for each layout it reads) and torch-side `preprocess.py` (`prepare_page`,
`count_image_tokens`, `most_image_tokens`), `modeling.py` (the model class) and `keys.py` (`LAYOUTS`,
`to_ours`, `to_vendor_state`, `expected_shapes`). The farm's parent names presets and modes from here
without importing torch; `ModelFamily.code()` imports the torch side on first use,
`ModelFamily.prepare_page` its `preprocess.py` alone. A third family is one more folder and one more line.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dsocr_workers.errors import CheckpointError, InputError
from dsocr_workers.model.config import ModeSpec, pick_mode

if TYPE_CHECKING:  # torch's side: this module is torch-free
    from PIL import Image

    from dsocr_workers.model.preprocess import PreparedPage


@dataclass(frozen=True)
class FamilyCode:
    """A family's torch side: what the checkpoint reader, the engine and the warm-up call."""

    model: type  # an nn.Module class: `model(config, attn_implementation, experts_implementation)`
    count_image_tokens: Callable[[ModeSpec, tuple[int, int]], int]
    most_image_tokens: Callable[[ModeSpec, int], int]
    keys: ModuleType  # LAYOUTS, to_ours(key, layout), to_vendor_state(state), expected_shapes(config, layout)


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its names, its torch-free facts and the stage its view encoder is timed as."""

    name: str  # what a run row records: "deepseek-ocr"
    title: str  # what people call it: "DeepSeek-OCR"
    package: str  # its package under dsocr_workers.model
    model_class: str  # the model class in its modeling.py
    encoder_stage: str  # the stage (stages.py) its view encoder is timed as: "vision/clip"
    presets: Mapping[str, Any]
    modes: Mapping[str, ModeSpec]
    default_mode: str
    max_crops: int
    matches: Callable[[dict[str, Any]], str | None]

    def mode(self, mode: str | ModeSpec) -> ModeSpec:
        """`mode` as this family knows it: an InputError naming its modes otherwise."""
        return pick_mode(dict(self.modes), mode, self.title)

    def crops(self, asked: int | None = None) -> int:
        """The most tiles a page is cut into: `asked`, checked against this family's limit (an InputError
        naming it otherwise), or the limit."""
        if asked is None:
            return self.max_crops
        if not 2 <= asked <= self.max_crops:
            raise InputError(
                f"--max-crops {asked}: {self.title} cuts a page into at most {self.max_crops} tiles (2 to "
                f"{self.max_crops})"
            )
        return asked

    def prepare_page(
        self,
        image: str | os.PathLike | bytes | Image.Image,
        encode: Callable[[str], list[int]],
        prompt: str | None = None,
        mode: str | None = None,
        max_crops: int | None = None,
    ) -> PreparedPage:
        """One page through the family's preprocessing, its prompt's ids made by `encode` (the tokenizer's,
        without added special tokens); None: the family's default mode, its own limit of tiles. Imports the
        family's `preprocess.py` alone (`preprocessing`), not its model."""
        return self.preprocessing().prepare_page(  # type: ignore[no-any-return]
            image, encode, mode=self.mode(mode or self.default_mode), prompt=prompt, max_crops=self.crops(max_crops)
        )

    def preprocessing(self) -> ModuleType:
        """The family's torch-side `preprocess.py`, imported alone: what a process that only prepares pages
        needs (farm/job/page_processes.py)."""
        return importlib.import_module(f"dsocr_workers.model.{self.package}.preprocess")

    def config_from(self, config_json: dict[str, Any], layout: str) -> Any:
        """The family's config from a `config.json` in `layout` (`matches` said which)."""
        config_class = type(next(iter(self.presets.values())))
        return getattr(config_class, f"from_{layout}")(config_json)

    def code(self) -> FamilyCode:
        """The torch side, imported on first use."""
        return _code(self.package, self.model_class)


def family(name: str, title: str, package: str, model_class: str, encoder_stage: str) -> ModelFamily:
    """A registry line: the family whose package is dsocr_workers.model.<package>."""
    config = importlib.import_module(f"dsocr_workers.model.{package}.config")
    return ModelFamily(
        name, title, package, model_class, encoder_stage, config.PRESETS, config.MODES, config.DEFAULT_MODE,
        config.MAX_CROPS, config.matches,
    )


@functools.cache
def _code(package: str, model_class: str) -> FamilyCode:
    base = f"dsocr_workers.model.{package}"
    preprocess = importlib.import_module(f"{base}.preprocess")
    return FamilyCode(
        getattr(importlib.import_module(f"{base}.modeling"), model_class),
        preprocess.count_image_tokens,
        preprocess.most_image_tokens,
        importlib.import_module(f"{base}.keys"),
    )


def _registry(*families: ModelFamily) -> dict[str, ModelFamily]:
    presets = [preset for f in families for preset in f.presets]
    clashes = sorted({p for p in presets if presets.count(p) > 1})
    if clashes:
        raise ValueError(f"model families: preset names used twice: {', '.join(clashes)}")
    return {f.name: f for f in families}


FAMILIES: dict[str, ModelFamily] = _registry(
    family("deepseek-ocr", "DeepSeek-OCR", "deepseek_ocr", "DeepSeekOCR", "vision/clip"),
    family("deepseek-ocr2", "DeepSeek-OCR-2", "deepseek_ocr2", "DeepSeekOCR2", "vision/qwen2"),
)


def all_presets() -> dict[str, ModelFamily]:
    """Every preset name, in registry order, with its family."""
    return {preset: f for f in FAMILIES.values() for preset in f.presets}


def family_of_preset(name: str) -> ModelFamily:
    presets = all_presets()
    if name not in presets:
        raise InputError(f"unknown preset {name!r}; presets: {', '.join(presets)}")
    return presets[name]


def detect(config_json: object, where: str = "config.json") -> tuple[ModelFamily, str]:
    """The family and layout a `config.json` describes; a CheckpointError naming what it found
    otherwise."""
    if isinstance(config_json, dict):
        for candidate in FAMILIES.values():
            layout = candidate.matches(config_json)
            if layout is not None:
                return candidate, layout
        found = {key: config_json.get(key) for key in ("model_type", "architectures")}
        described = ", ".join(f"{key} {value!r}" for key, value in found.items() if value is not None)
    else:
        described = f"a JSON {type(config_json).__name__}, not an object"
    titles = ", ".join(f.title for f in FAMILIES.values())
    raise CheckpointError(
        f"{where} describes none of the model families this farm runs ({titles}): "
        f"found {described or 'neither model_type nor architectures'}"
    )


def read_config_json(directory: str | Path) -> dict[str, Any]:
    """A checkpoint directory's `config.json`; InputError if there is no such directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(
            f"{directory}: not a checkpoint directory (nor a preset: {', '.join(all_presets())})"
        )
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path}: not JSON ({exc})") from exc


def family_of_checkpoint(directory: str | Path) -> ModelFamily:
    """The family of a checkpoint directory, from its `config.json`."""
    return detect(read_config_json(directory), str(Path(directory) / "config.json"))[0]


def family_of_config(config: object) -> ModelFamily:
    """The family whose presets' config class `config` is an instance of."""
    for candidate in FAMILIES.values():
        if isinstance(config, type(next(iter(candidate.presets.values())))):
            return candidate
    raise TypeError(f"{type(config).__name__} is no model family's config")


def family_of_model(source: str) -> ModelFamily:
    """The family of a run's `--model`: a preset name or a checkpoint directory."""
    return all_presets()[source] if source in all_presets() else family_of_checkpoint(source)


def all_modes() -> tuple[str, ...]:
    """Every family's mode names, in registry order: what a command line offers before it knows the
    model (a run's model then checks its own, `run_mode`)."""
    return tuple(dict.fromkeys(mode for f in FAMILIES.values() for mode in f.modes))


def run_mode(model: str, mode: str | None) -> str:
    """The mode a run of `model` uses: `mode`, checked against the model's family (an InputError naming
    its modes), or the family's default when None."""
    found = family_of_model(model)
    return found.mode(mode).name if mode is not None else found.default_mode
