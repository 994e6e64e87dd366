"""An answer drawn on its photo (`predict --draw`): a detector's boxes with their labels and
scores (torchvision's `draw_bounding_boxes`), a classifier's top classes as a caption. The photo
is read as the server reads it (EXIF orientation applied), so boxes land where they were found.
torch and Pillow are imported when a drawing is made."""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# A colour per class index (the same class, the same colour in every picture).
# Dark enough for the white label text.
PALETTE = ("#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#c2185b", "#469990", "#9a6324",
           "#800000", "#808000", "#000075", "#00695c", "#6a1b9a", "#bf360c", "#1b5e20", "#37474f")
CAPTION_CLASSES = 3


def is_detection_answer(answer: Sequence[Any]) -> bool:
    return bool(answer) and isinstance(answer[0], dict) and "box" in answer[0]


def detection_label(detection: dict[str, Any]) -> str:
    """`label score`, and a detect-then-classify pipeline's best class of the box."""
    text = f"{detection['label']} {detection['score']:.2f}"
    classes = detection.get("classification") or []
    if classes:
        text += f" / {classes[0]['label']} {classes[0]['probability']:.2f}"
    return text


def caption(answer: Sequence[dict[str, Any]]) -> str:
    """A classifier's (or cascade's) best classes on one line."""
    if not answer:
        return "(no answer)"
    return "   ".join(f"{entry['label']} {entry['probability']:.2f}" for entry in answer[:CAPTION_CLASSES])


def drawn_answer(image_bytes: bytes, answer: Sequence[Any]) -> Any:
    """The photo (a PIL image, RGB) with `answer` drawn on it."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(image_bytes)) as opened:
        photo = ImageOps.exif_transpose(opened).convert("RGB")
    if is_detection_answer(answer):
        return with_boxes(photo, answer)
    return with_caption(photo, caption(answer))


def with_boxes(photo: Any, detections: Sequence[dict[str, Any]]) -> Any:
    import torch
    from torchvision.transforms.v2 import functional as F
    from torchvision.utils import draw_bounding_boxes

    pixels = F.pil_to_tensor(photo)
    boxes = torch.tensor([detection["box"] for detection in detections], dtype=torch.float32)
    colours = [PALETTE[int(detection.get("index", 0)) % len(PALETTE)] for detection in detections]
    width = max(2, min(photo.size) // 200)
    drawn = draw_bounding_boxes(pixels, boxes, labels=[detection_label(d) for d in detections],
                                colors=colours, width=width, fill_labels=True, label_colors="white")
    return F.to_pil_image(drawn)


def with_caption(photo: Any, text: str) -> Any:
    """The photo under a band that holds `text`."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=max(12, photo.size[0] // 40))
    _, top, _, bottom = ImageDraw.Draw(photo).textbbox((0, 0), text, font=font)
    band = int(bottom - top) + 12
    framed = Image.new("RGB", (photo.size[0], photo.size[1] + band), "black")
    framed.paste(photo, (0, band))
    ImageDraw.Draw(framed).text((6, 6 - top), text, fill="white", font=font)
    return framed


def save_drawing(image_bytes: bytes, answer: Sequence[Any], target: Path) -> None:
    """Draw `answer` on the photo and write it to `target` as PNG (folders made as needed): to a
    temporary file beside it first, renamed into place once complete, so that `target` is never
    a partial PNG."""
    target.parent.mkdir(parents=True, exist_ok=True)
    drawn = drawn_answer(image_bytes, answer)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", suffix=".part",
                                     delete=False) as partial:
        try:
            drawn.save(partial, format="PNG")
            partial.flush()
            os.fsync(partial.fileno())
        except BaseException:
            os.unlink(partial.name)
            raise
    os.replace(partial.name, target)
