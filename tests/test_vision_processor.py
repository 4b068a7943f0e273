"""The host-side image / video processor (k3jax.data.vision_processor) against docs/vision.md §1:
the spec's geometry examples, pixels and patch order against Pillow directly, K3's chessboard,
extreme sizes, bucketing, the media limit, K2.5 video chunks and their timestamps, bad files."""
import io

import numpy as np
import pytest
from PIL import Image

from k3jax.config import load
from k3jax.data import vision_processor as vp
from k3jax.schema import ConfigError

PAD = "<|media_pad|>"


def norm(u):
    """docs/vision.md §1.1 step 5: (u8/255 - 0.5)/0.5."""
    return (np.asarray(u, np.float64) / 255 - 0.5) / 0.5


def expected_patches(rgb: np.ndarray, gh: int, gw: int, p: int = 14) -> np.ndarray:
    """[gh*gw, 3*p*p] built element by element from a uint8 [h, w, 3] image: patch (row, col) in
    raster order, inside it (c, y, x); pixels beyond the image are black padding (-1)."""
    h, w, _ = rgb.shape
    out = np.empty((gh * gw, 3 * p * p))
    for r in range(gh):
        for col in range(gw):
            for c in range(3):
                for y in range(p):
                    for x in range(p):
                        yy, xx = r * p + y, col * p + x
                        u = rgb[yy, xx, c] if yy < h and xx < w else 0
                        out[r * gw + col, (c * p + y) * p + x] = norm(u)
    return out


def coded_image(w: int, h: int) -> Image.Image:
    """RGB whose values encode (y, x, c): R = 5y, G = 5x, B = (7y + 3x) mod 256."""
    y, x = np.mgrid[:h, :w]
    return Image.fromarray(np.stack([5 * y, 5 * x, (7 * y + 3 * x) % 256], -1).astype(np.uint8))


# docs/vision.md §1.1 examples: (processor, W, H, (gh, gw), tokens).
EXAMPLES = [("K25", 1000, 750, (54, 72), 972), ("K3", 1000, 750, (54, 72), 972),
            ("K25", 1920, 1080, (78, 138), 2691), ("K3", 1920, 1080, (78, 138), 2691),
            ("K25", 4000, 3000, (112, 150), 4200), ("K3", 4000, 3000, (216, 286), 15444),
            ("K25", 20, 10, (2, 2), 1), ("K3", 20, 10, (2, 2), 1),
            ("K25", 8000, 100, (8, 512), 1024), ("K3", 8000, 100, (8, 512), 1024)]


@pytest.mark.parametrize("proc,w,h,grid,tokens", EXAMPLES, ids=[f"{e[0]}-{e[1]}x{e[2]}" for e in EXAMPLES])
def test_spec_examples_grid_and_tokens(proc, w, h, grid, tokens):
    pcfg = getattr(vp, proc)
    plan = vp.resize_plan(w, h, pcfg)
    assert ((plan.grid_h, plan.grid_w), plan.tokens) == (grid, tokens)
    assert plan.grid_h % 2 == plan.grid_w % 2 == 0 and max(grid) <= 512
    if w * h <= 1920 * 1080:    # the 4000x3000 photos are the same code path, 2.5 s more
        item = vp.process_image(Image.new("RGB", (w, h), (10, 20, 30)), pcfg)
        assert item.grid_thw == (1, *grid) and item.tokens == tokens
        assert item.patches.shape == (grid[0] * grid[1], 588) and item.patches.dtype == np.float32
        assert item.prompt.count(PAD) == tokens


def test_pixels_and_patch_order_without_resize():
    img = coded_image(45, 31)                    # s = 1; pads to 56 x 56: grid 4 x 4
    item = vp.process_image(img, vp.K3)
    assert item.grid_thw == (1, 4, 4) and item.tokens == 4
    np.testing.assert_allclose(item.patches, expected_patches(np.asarray(img), 4, 4), rtol=0, atol=1e-6)


def test_normalisation_bit_equal_to_the_reference_formula():
    """float32(u/255), then - mean and * 1/std in place (Moonshot's normalize), for every byte."""
    pcfg = vp.ProcessorConfig(mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711))
    y, x, c = np.mgrid[:28, :280, :3]
    u = ((280 * y + x + 85 * c) % 256).astype(np.uint8)[None]          # every byte on every channel
    want = (u / 255.0).astype(np.float32)
    want -= np.asarray(pcfg.mean)
    want *= 1.0 / np.asarray(pcfg.std)
    got = vp.patchify(u, pcfg).reshape(2, 20, 3, 14, 14).transpose(0, 3, 1, 4, 2).reshape(1, 28, 280, 3)
    np.testing.assert_array_equal(got, want)


def test_pixels_after_bicubic_resize_equal_pillow():
    img = coded_image(90, 60)                    # 6 x 4 patches over a budget of 4: s = sqrt(4/24)
    pcfg = vp.ProcessorConfig(in_patch_limit=4)
    item = vp.process_image(img, pcfg)
    s = np.sqrt(4 / 24)
    w, h = int(90 * s), int(60 * s)
    assert (w, h) == (36, 24) and item.grid_thw == (1, 2, 4)
    direct = np.asarray(img.resize((w, h), Image.Resampling.BICUBIC))
    np.testing.assert_allclose(item.patches, expected_patches(direct, 2, 4), rtol=0, atol=1e-6)
    # The prompt names the size given, not the resized one.
    assert item.prompt_prefix == "<|media_begin|>image 90x60<|media_content|>"


def test_prompts_k3_and_k25():
    img = Image.new("RGB", (40, 30))
    k3, k25 = vp.process_image(img, vp.K3), vp.process_image(img, vp.K25)
    assert k3.prompt == "<|media_begin|>image 40x30<|media_content|>" + PAD * 4 + "<|media_end|>"
    assert k25.prompt == "<|media_begin|>image<|media_content|>" + PAD * 4 + "<|media_end|>"
    assert vp.process_image(img, vp.K3, prompt_size=(400, 300)).prompt.startswith(
        "<|media_begin|>image 400x300<|media_content|>")


def chessboard_value(y, x):
    return 180 if (y // 8 + x // 8) % 2 else 255


def pixel(item, gw, y, x, c=0):
    """Normalised value of image pixel (y, x, c) read back from the patches."""
    return item.patches[(y // 14) * gw + x // 14, (c * 14 + y % 14) * 14 + x % 14]


def test_rgba_composited_on_chessboard_k3_and_dropped_k25():
    a = np.zeros((28, 28, 4), np.uint8)
    a[:, :10] = (200, 0, 0, 0)                    # transparent, with colour that must not show
    a[:, 10:20] = (40, 40, 40, 128)               # half transparent
    a[:, 20:] = (10, 20, 30, 255)                 # opaque
    img = Image.fromarray(a, "RGBA")
    k3 = vp.process_image(img, vp.K3)
    assert k3.grid_thw == (1, 2, 2)
    for y in (0, 7, 8, 15, 16, 27):
        for x in (0, 7, 8, 9):
            assert pixel(k3, 2, y, x) == pytest.approx(norm(chessboard_value(y, x)))
        # 128/255 * 40 + 127/255 * bg, truncated: 147 over white, 109 over gray.
        for x in (10, 15, 16, 19):
            want = 147 if chessboard_value(y, x) == 255 else 109
            assert pixel(k3, 2, y, x) == pytest.approx(norm(want))
        assert [pixel(k3, 2, y, 25, c) for c in range(3)] == pytest.approx(norm([10, 20, 30]))
    k25 = vp.process_image(img, vp.K25)          # alpha dropped: the stored colour comes back
    assert [pixel(k25, 2, 3, 3, c) for c in range(3)] == pytest.approx(norm([200, 0, 0]))
    assert pixel(k25, 2, 3, 12) == pytest.approx(norm(40))


def test_transparency_of_la_and_palette_images_and_after_resize():
    la = Image.fromarray(np.zeros((20, 20, 2), np.uint8), "LA")        # fully transparent
    pal = Image.new("P", (20, 20), 3)
    pal.info["transparency"] = 3                                        # palette index 3 transparent
    opaque_pal = Image.new("P", (20, 20), 3)
    opaque_pal.putpalette([0, 0, 0] * 3 + [70, 80, 90])
    for img in (la, pal):
        item = vp.process_image(img, vp.K3)
        assert [pixel(item, 2, y, x) for y, x in ((0, 0), (0, 8), (9, 9), (19, 3), (12, 3))] == pytest.approx(
            norm([255, 180, 255, 255, 180]))
        assert pixel(item, 2, 25, 25) == -1.0                           # padding stays black
    assert [pixel(vp.process_image(opaque_pal, vp.K3), 2, 5, 5, c) for c in range(3)] == pytest.approx(
        norm([70, 80, 90]))
    # Compositing comes after the resize: the chessboard is drawn at the resized size, sharp.
    big = Image.fromarray(np.full((60, 90, 4), (255, 0, 0, 0), np.uint8), "RGBA")
    item = vp.process_image(big, vp.ProcessorConfig(in_patch_limit=4))   # -> 36 x 24
    assert item.grid_thw == (1, 2, 4)
    got = np.array([[pixel(item, 4, y, x) for x in range(36)] for y in range(24)])
    np.testing.assert_allclose(got, norm([[chessboard_value(y, x) for x in range(36)] for y in range(24)]),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("pcfg", [vp.K3, vp.K25], ids=["K3", "K25"])
def test_one_pixel_and_extreme_aspect_ratios(pcfg):
    one = vp.process_image(Image.new("RGB", (1, 1), (255, 0, 255)), pcfg)
    assert one.grid_thw == (1, 2, 2) and one.tokens == 1 and one.patches.shape == (4, 588)
    assert [pixel(one, 2, 0, 0, c) for c in range(3)] == [1.0, -1.0, 1.0]
    assert (one.patches[1:] == -1).all() and (one.patches[0, 1:196] == -1).all()
    # 20000 x 10: the side limit scales by 7168/20000; the 10 px side becomes 3 px, padded to 28.
    assert vp.resize_plan(20000, 10, pcfg) == vp.ResizePlan(7168, 3, 0, 25, 2, 512, 256)
    wide = vp.process_image(Image.new("RGB", (20000, 10), (255, 255, 255)), pcfg)
    assert wide.grid_thw == (1, 2, 512) and wide.tokens == 256
    assert pixel(wide, 512, 2, 7000) == pytest.approx(1.0) and pixel(wide, 512, 3, 7000) == -1.0
    tall = vp.process_image(Image.new("RGB", (10, 20000)), pcfg)
    assert tall.grid_thw == (1, 512, 2) and tall.tokens == 256


def test_patch_buckets_and_packing():
    assert [vp.patch_bucket(n, vp.K3) for n in (1, 256, 257, 4096, 4097)] == [256, 256, 512, 4096, 8192]
    pcfg = vp.ProcessorConfig(patch_buckets=(64, 1024, 4096))
    assert [vp.patch_bucket(n, pcfg) for n in (4, 64, 65, 4096)] == [64, 64, 1024, 4096]
    with pytest.raises(vp.VisionInputError, match="4097 patches exceed the largest vision_patch_buckets entry 4096"):
        vp.patch_bucket(4097, pcfg)
    with pytest.raises(ConfigError, match="vision_patch_buckets"):
        vp.ProcessorConfig(patch_buckets=(1024, 64))
    a = vp.process_image(coded_image(20, 10), vp.K3)          # 2 x 2
    b = vp.process_image(coded_image(80, 50), vp.K3)          # 4 x 6
    packed = vp.pack_media([a, b], pcfg)
    assert packed.patches.shape == (64, 588) and packed.patches.dtype == np.float32
    np.testing.assert_array_equal(packed.segment_ids, [1] * 4 + [2] * 24 + [0] * 36)
    np.testing.assert_array_equal(packed.patches[:4], a.patches)
    np.testing.assert_array_equal(packed.patches[4:28], b.patches)
    assert not packed.patches[28:].any()
    np.testing.assert_array_equal(packed.grid_thw, [[1, 2, 2], [1, 4, 6]])
    np.testing.assert_array_equal(packed.tokens, [1, 6])
    with pytest.raises(vp.VisionInputError, match="28 patches do not fit a bucket of 16"):
        vp.pack_media([a, b], pcfg, bucket=16)


def test_media_limit():
    vp.check_media_limit(16, vp.K3)
    with pytest.raises(vp.VisionInputError, match=r"request has 17 images/videos, over vision_max_images=16"):
        vp.check_media_limit(17, vp.K3, "request")
    vp.check_media_limit(1000, vp.ProcessorConfig(max_images=0))


def test_k25_video_sampling_chunks_and_timestamps():
    frames = np.zeros((25, 28, 56, 3), np.uint8)
    frames += np.arange(25, dtype=np.uint8)[:, None, None, None] * 10     # frame i holds 10*i
    # 25 frames at 5 fps, sampled at 2 fps: round(25*2/5) = 10 frames at round(linspace(0, 24, 10)).
    assert vp.sample_frame_indices(25, 5.0, 2.0) == [0, 3, 5, 8, 11, 13, 16, 19, 21, 24]
    chunks = vp.process_video(frames, 5.0, vp.K25)
    assert [c.grid_thw for c in chunks] == [(4, 2, 4), (4, 2, 4), (2, 2, 4)]
    assert [c.tokens for c in chunks] == [2, 2, 2]
    assert [c.prompt for c in chunks] == [
        f"{ts}<|media_begin|>video<|media_content|>{PAD * 2}<|media_end|>"
        for ts in ("00:00:00.000", "00:00:02.200", "00:00:04.200")]
    # Patches are frame-major: chunk 1's frames are sampled frames 11, 13, 16, 19.
    per_frame = chunks[1].patches.reshape(4, 8, 588)
    for f, src in enumerate((11, 13, 16, 19)):
        np.testing.assert_allclose(per_frame[f], norm(10 * src), rtol=0, atol=1e-6)
    assert vp.timestamp_text(3725.5) == "01:02:05.500"
    assert vp.sample_frame_indices(3, 1.0, 2.0) == [0, 1, 2]          # never above the source fps
    with pytest.raises(vp.VisionInputError, match="vision_video=true"):
        vp.process_video(frames, 5.0, vp.K3)
    with pytest.raises(vp.VisionInputError, match="differ in size"):
        vp.process_video([Image.new("RGB", (28, 28)), Image.new("RGB", (56, 28))], 1.0, vp.K25)


def test_video_frames_use_the_per_frame_budget():
    frames = [Image.new("RGB", (1920, 1080))] * 2
    (chunk,) = vp.process_video(frames, 2.0, vp.K25)
    plan = vp.resize_plan(1920, 1080, vp.K25, patch_limit=4096)
    assert chunk.grid_thw == (2, plan.grid_h, plan.grid_w) and plan.grid_h * plan.grid_w < 4096 + 512
    assert chunk.tokens == plan.grid_h * plan.grid_w // 4


def test_animated_gif(tmp_path):
    path = tmp_path / "clip.gif"
    frames = [Image.new("RGB", (28, 28), (40 * i, 0, 0)) for i in range(6)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=250, loop=0)
    got, fps = vp.load_video(path)
    assert len(got) == 6 and fps == pytest.approx(4.0)
    # 6 frames at 4 fps -> 3 frames at round(linspace(0, 5, 3)) = [0, 2, 5] (2.5 rounds to even).
    (chunk,) = vp.process_video(got, fps, vp.K25)
    assert chunk.grid_thw == (3, 2, 2)
    reds = chunk.patches.reshape(3, 4, 588)[:, 0, 0]
    assert reds == pytest.approx(np.float32(norm([0, 80, 200])), abs=0.02)   # GIF palette rounding


def test_unreadable_missing_and_truncated_files(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(vp.VisionInputError, match=r"bad\.png: unreadable image") as e:
        vp.load_image(bad)
    assert "\n" not in str(e.value)
    buf = io.BytesIO()
    coded_image(64, 64).save(buf, "PNG")
    cut = tmp_path / "cut.png"
    cut.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(vp.VisionInputError, match=r"cut\.png: unreadable image"):
        vp.load_image(cut)
    with pytest.raises(vp.VisionInputError, match=r"nope\.jpg: image file not found"):
        vp.load_image(tmp_path / "nope.jpg")
    assert vp.load_image(buf.getvalue()).size == (64, 64)
    with pytest.raises(vp.VisionInputError, match=r"bad\.png: unreadable image"):
        vp.process_image(bad)                    # a path goes through load_image
    with pytest.raises(vp.VisionInputError, match="image of mode La: cannot resize or convert it to RGB"):
        vp.process_image(Image.new("La", (4, 4)))


def test_processor_from_config():
    base = "configs/base.yml"
    assert vp.from_config(load(base, [])) == vp.K3
    assert vp.from_config(load(base, ["model_name=kimi-k3-vl"])) == vp.K3
    assert vp.from_config(load(base, ["model_name=kimi-k25"])) == vp.K25
    got = vp.from_config(load(base, ["vision_patch_buckets=[64,256]", "vision_max_images=2"]))
    assert got.patch_buckets == (64, 256) and got.max_images == 2
    with pytest.raises(ConfigError, match="vision_transparent_bg"):
        vp.ProcessorConfig(transparent_bg="white")
