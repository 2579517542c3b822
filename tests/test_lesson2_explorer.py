"""The partition explorer without a live frontend: it must still show a static plot."""

import base64

import matplotlib

matplotlib.use("Agg")

import IPython.display  # noqa: E402

from ddp_helpers.course.lessons.lesson2.explorer import partition_explorer, sampler_partition  # noqa: E402


def test_sampler_partition_follows_set_epoch():
    epoch0 = sampler_partition(12, 3, 0, call_set_epoch=True)
    assert sorted(i for rank in epoch0 for i in rank) == list(range(12))
    assert sampler_partition(12, 3, 2, call_set_epoch=False) == epoch0
    assert sampler_partition(12, 3, 2, call_set_epoch=True) != epoch0


def test_explorer_output_carries_the_widget_and_a_static_png(monkeypatch):
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    partition_explorer()
    (bundle,) = shown
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    assert "static plot" in bundle["text/plain"]
