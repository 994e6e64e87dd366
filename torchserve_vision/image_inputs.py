"""The images a command is given: files and folders (searched recursively), each image with the
path it is reported under and the path it is drawn under. Imports no torch."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torchserve_vision.errors import CommandError

# What the handlers decode (handlers/request/decode.py): JPEG, PNG, WebP, BMP, GIF, TIFF.
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif",
                            ".tiff"})


class InputError(CommandError):
    """A path the command was given cannot be read, or holds no image."""


@dataclass(frozen=True)
class ImageInput:
    """One image: `path` resolved (absolute, what the answer line names: `photos/` and
    `$PWD/photos` give the same paths), `relative` its path below the folder it was found in (its
    own name for a file given directly)."""

    path: Path
    relative: Path

    @property
    def key(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class ImageInputs:
    images: tuple[ImageInput, ...]
    skipped: int            # files found in the folders that are not images (by their suffix)


def is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES


def found_images(paths: Sequence[Path]) -> ImageInputs:
    """Every image of `paths` once (by its resolved path): a file as given (whatever its suffix:
    the server decides), a folder's images recursively, sorted by path; InputError for a path
    that does not exist or cannot be read, and when there is no image at all."""
    images: list[ImageInput] = []
    skipped = 0
    for given in paths:
        path = given.resolve() if given.exists() else given
        if path.is_dir():
            found, others = folder_images(path)
            images += found
            skipped += others
        elif path.is_file():
            if not os.access(path, os.R_OK):
                raise InputError(f"{path}: cannot be read (permission denied)")
            images.append(ImageInput(path, Path(path.name)))
        elif path.exists() or path.is_symlink():
            raise InputError(f"{path}: not a file or a folder")
        else:
            raise InputError(f"{path}: no such file or folder")
    if not images:
        raise InputError(f"no images in {', '.join(str(path) for path in paths)} "
                         f"({skipped} other file(s); images are {', '.join(sorted(IMAGE_SUFFIXES))})")
    unique = {image.key: image for image in reversed(images)}      # the first of each path kept
    return ImageInputs(tuple(image for image in images if unique[image.key] is image), skipped)


def folder_images(folder: Path) -> tuple[list[ImageInput], int]:
    """The images below `folder` (hidden files and folders left out) and how many other files."""
    if not os.access(folder, os.R_OK | os.X_OK):
        raise InputError(f"{folder}: cannot be read (permission denied)")
    images, skipped = [], 0
    for root, folders, files in os.walk(folder, onerror=walk_failed):
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = Path(root) / name
            if is_image(path):
                images.append(ImageInput(path, path.relative_to(folder)))
            else:
                skipped += 1
    return images, skipped


def walk_failed(error: OSError) -> None:
    raise InputError(f"{error.filename}: cannot be read ({error.strerror})")


def drawing_paths(images: Sequence[ImageInput], target: Path, several: bool) -> dict[str, Path]:
    """Where each image's drawing goes: `target` itself for one image given alone, else
    `target/<its path below its folder>` with `.png` added unless it ends so. InputError when
    two images would be drawn to the same file."""
    if not several:
        return {images[0].key: target}
    paths: dict[str, Path] = {}
    taken: dict[Path, str] = {}
    for image in images:
        relative = image.relative if image.relative.suffix.lower() == ".png" else \
            image.relative.with_name(image.relative.name + ".png")
        drawn = target / relative
        if drawn in taken:
            raise InputError(f"{taken[drawn]} and {image.key} would both be drawn to {drawn}: "
                             "draw them in separate runs")
        taken[drawn] = image.key
        paths[image.key] = drawn
    return paths
