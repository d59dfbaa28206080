"""Checks that a file is a PNG matplotlib can read back, with a real picture in it."""

from __future__ import annotations

from pathlib import Path


def assert_png(path: str | Path, min_side: int = 100) -> None:
    import matplotlib.image

    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    image = matplotlib.image.imread(str(path))
    assert image.shape[0] >= min_side and image.shape[1] >= min_side, image.shape
    assert image[..., :3].std() > 0.01, f"{path} is blank"
