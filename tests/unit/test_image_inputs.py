"""The images of the paths given to `predict`: folders searched recursively, other files counted,
clear errors for paths that cannot be used, drawings that cannot clash."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchserve_vision.image_inputs import ImageInput, InputError, drawing_paths, found_images


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def test_folders_are_searched_recursively_and_other_files_counted(tmp_path):
    for name in ("b.JPG", "a.png", "sub/c.webp", "sub/deeper/d.tiff", "notes.txt", "sub/data.csv",
                 ".hidden/e.png", ".f.png"):
        touch(tmp_path / name)
    given = touch(tmp_path / "elsewhere" / "scan.raw")       # a file given directly: the server decides
    found = found_images([tmp_path / "sub", tmp_path, given])
    # an image found twice (sub/ and the folder above it) once, as first found
    assert [image.relative.as_posix() for image in found.images] == [
        "c.webp", "deeper/d.tiff", "a.png", "b.JPG", "scan.raw"]
    assert found.skipped == 1 + 3     # data.csv (first folder), then notes.txt, data.csv, scan.raw


def test_paths_are_resolved_so_a_folder_given_two_ways_is_one(tmp_path, monkeypatch):
    touch(tmp_path / "photos" / "a.png")
    touch(tmp_path / "photos" / "sub" / "b.png")
    monkeypatch.chdir(tmp_path)
    found = found_images([Path("photos/"), tmp_path / "photos", Path("photos/sub/../a.png")])
    assert [image.key for image in found.images] == [str(tmp_path.resolve() / "photos" / "a.png"),
                                                     str(tmp_path.resolve() / "photos" / "sub" / "b.png")]


def test_a_missing_path_or_no_images_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match=r"missing\.jpg: no such file or folder"):
        found_images([tmp_path / "missing.jpg"])
    touch(tmp_path / "notes.txt")
    with pytest.raises(InputError, match=r"no images in .* \(1 other file"):
        found_images([tmp_path])


def test_an_unreadable_file_or_folder_is_an_input_error(tmp_path, monkeypatch):
    image = touch(tmp_path / "photo.jpg")
    monkeypatch.setattr(os, "access", lambda path, mode: False)     # as a user without permission sees it
    with pytest.raises(InputError, match=r"photo\.jpg: cannot be read"):
        found_images([image])
    with pytest.raises(InputError, match="cannot be read"):
        found_images([tmp_path])


def test_drawings_keep_relative_paths_and_refuse_clashes(tmp_path):
    images = [ImageInput(Path("/p/a.jpg"), Path("a.jpg")),
              ImageInput(Path("/p/sub/a.png"), Path("sub/a.png"))]
    assert drawing_paths(images, tmp_path, several=True) == {
        "/p/a.jpg": tmp_path / "a.jpg.png", "/p/sub/a.png": tmp_path / "sub" / "a.png"}
    one = drawing_paths(images[:1], tmp_path / "one.png", several=False)
    assert one == {"/p/a.jpg": tmp_path / "one.png"}
    clash = [ImageInput(Path("/p/x.png"), Path("x.png")), ImageInput(Path("/q/x.png"), Path("x.png"))]
    with pytest.raises(InputError, match="would both be drawn to"):
        drawing_paths(clash, tmp_path, several=True)
