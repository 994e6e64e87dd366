"""Photo sets for build-time calibration and gates: the project's photos or a folder's, split by
source so that no scene is on both sides, grown with seeded variants (pure, PIL only)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from torchserve_vision.photo_sets import (
    Photo,
    PhotoSetError,
    folder_photos,
    load_photos,
    project_photos,
    split_by_source,
    variant_jpegs,
)


def solid(colour: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> Image.Image:
    return Image.new("RGB", size, colour)


def photos(*sources: str) -> list[Photo]:
    return [Photo(f"{source}-{index}.png", source, solid((index * 40, 0, 0)))
            for source in sources for index in range(2)]


def test_the_project_photos_are_real_colour_photos_and_the_stereo_pair_is_one_source():
    found = project_photos()
    assert {photo.source for photo in found} == {"astronaut", "chelsea", "coffee", "motorcycle", "rocket"}
    stereo_pair = [p.name for p in found if p.source == "motorcycle"]
    assert stereo_pair == ["motorcycle_left.png", "motorcycle_right.png"]
    assert all(photo.image.mode == "RGB" and min(photo.image.size) >= 256 for photo in found)
    assert [p.name for p in load_photos(None)] == [p.name for p in found]


def test_a_split_never_puts_one_source_on_both_sides_and_does_not_depend_on_order():
    given = photos("a", "b", "c", "d", "e")
    kept, held = split_by_source(given, 0.4)
    assert {p.source for p in kept}.isdisjoint({p.source for p in held})
    assert len({p.source for p in held}) == 2 and len(kept) + len(held) == len(given)
    again_kept, again_held = split_by_source(list(reversed(given)), 0.4)
    assert {p.name for p in again_held} == {p.name for p in held}
    assert {p.name for p in again_kept} == {p.name for p in kept}


@pytest.mark.parametrize("share", [0.0, 0.99])
def test_each_side_of_a_split_keeps_at_least_one_source(share):
    kept, held = split_by_source(photos("a", "b", "c"), share)
    assert kept and held


def test_a_single_scene_cannot_be_split():
    with pytest.raises(PhotoSetError, match="at least two scenes"):
        split_by_source(photos("only"), 0.4)


def test_a_folder_gives_its_images_each_its_own_source(tmp_path):
    for name, colour in (("b.jpg", (0, 90, 0)), ("a.png", (90, 0, 0))):
        solid(colour).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not a photo")
    found = folder_photos(tmp_path)
    assert [(p.name, p.source) for p in found] == [("a.png", "a"), ("b.jpg", "b")]
    assert found[0].image.getpixel((0, 0)) == (90, 0, 0)


def test_a_folder_without_usable_photos_says_which_and_why(tmp_path):
    with pytest.raises(PhotoSetError, match="is not a folder"):
        folder_photos(tmp_path / "missing")
    with pytest.raises(PhotoSetError, match="holds no photos"):
        folder_photos(tmp_path)
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(PhotoSetError, match=r"broken\.jpg cannot be read"):
        folder_photos(tmp_path)


def test_variants_are_distinct_seeded_jpegs_starting_with_each_photo_whole():
    given = [Photo("cat", "cat", Image.effect_noise((300, 200), 60).convert("RGB")),
             Photo("cup", "cup", Image.effect_noise((200, 300), 30).convert("RGB"))]
    bodies = variant_jpegs(given, 12, seed=3)
    assert len(bodies) == len(set(bodies)) == 12
    assert variant_jpegs(given, 12, seed=3) == bodies
    assert variant_jpegs(given, 12, seed=4)[2:] != bodies[2:]
    assert [Image.open(io.BytesIO(body)).size for body in bodies[:2]] == [(300, 200), (200, 300)]
    assert all(min(Image.open(io.BytesIO(body)).size) >= 180 for body in bodies[2:])
