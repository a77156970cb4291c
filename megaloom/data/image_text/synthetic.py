"""The embedded image-text set: one or two simple shapes per image (circle, square, triangle, cross) in a named
colour at a named place on a plain background, drawn with PIL; the caption is made from the same choices, so
it is always true of its image. Record ``i`` is a function of (seed, i) alone: nothing is stored, the images are
drawn again when the loader asks for them."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40),
           "purple": (140, 60, 180), "orange": (245, 140, 30), "white": (245, 245, 245), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle", "cross")
PLACES = {"top left": (0.25, 0.25), "top right": (0.75, 0.25), "bottom left": (0.25, 0.75),
          "bottom right": (0.75, 0.75), "centre": (0.5, 0.5)}
BACKGROUNDS = {"grey": (128, 128, 128), "light blue": (170, 200, 230), "beige": (225, 210, 180)}
SIZE = 64  # drawn at this size, then resized to model.image_size like any other image
QUESTIONS = ("What is in the image?", "Describe the picture.", "Which shape do you see, and where?")


def _scene(rng: np.random.Generator) -> tuple[list[tuple[str, str, str]], str]:
    n = 1 + int(rng.random() < 0.3)
    places = rng.choice(list(PLACES), size=n, replace=False)
    shapes = [(str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES)), str(p)) for p in places]
    return shapes, str(rng.choice(list(BACKGROUNDS)))


def record(seed: int, i: int) -> dict:
    """Record i: a caption pair (one image), a two-image comparison, or a question-answer conversation."""
    rng = np.random.default_rng([seed, i])
    kind = rng.random()
    scenes = [_scene(rng) for _ in range(2 if kind < 0.15 else 1)]
    describe = [" and ".join(f"a {c} {s} at the {p}" for c, s, p in shapes) + f" on a {bg} background"
                for shapes, bg in scenes]
    images = [("synthetic", seed, i, k) for k in range(len(scenes))]
    if len(scenes) == 2:
        text = f"The first image shows {describe[0]}. The second image shows {describe[1]}."
        return {"images": images, "turns": [("prompt", "<image><image>"), ("answer", text)]}
    if kind < 0.5:
        return {"images": images, "turns": [("prompt", f"<image>USER: {QUESTIONS[int(rng.integers(3))]}\n"
                                                       "ASSISTANT: "), ("answer", describe[0].capitalize() + ".")]}
    return {"images": images, "turns": [("prompt", "<image>"), ("answer", describe[0].capitalize() + ".")]}


def draw(seed: int, i: int, k: int) -> Image.Image:
    """Image k of record i (the same random choices as `record`, so the caption describes it)."""
    rng = np.random.default_rng([seed, i])
    kind = rng.random()
    scenes = [_scene(rng) for _ in range(2 if kind < 0.15 else 1)]
    shapes, bg = scenes[k]
    img = Image.new("RGB", (SIZE, SIZE), BACKGROUNDS[bg])
    d = ImageDraw.Draw(img)
    r = SIZE // 6
    for colour, shape, place in shapes:
        cx, cy = (int(v * SIZE) for v in PLACES[place])
        fill = COLOURS[colour]
        if shape == "circle":
            d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        elif shape == "square":
            d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
        elif shape == "triangle":
            d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
        else:
            d.rectangle((cx - r, cy - r // 3, cx + r, cy + r // 3), fill=fill)
            d.rectangle((cx - r // 3, cy - r, cx + r // 3, cy + r), fill=fill)
    return img
