"""The medium a tier's KV events carry is a fact of its registry line, spelt as vLLM spells its own tiers."""

from __future__ import annotations

import pytest

from kvpool.errors import ConfigError
from kvpool.events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE
from kvpool.tiers import TierKind
from kvpool.tiers.store import BACKENDS, event_medium, medium_links


def test_vllm_spellings() -> None:
    # vllm.distributed.kv_events.MEDIUM_GPU, and vllm.v1.kv_offload.base.Medium's two members
    assert (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE) == ("GPU", "CPU", "STORAGE")


def test_each_tier_names_its_medium() -> None:
    assert event_medium("cpu") == MEDIUM_CPU
    assert event_medium("disk") == MEDIUM_STORAGE
    assert event_medium("redis") == MEDIUM_STORAGE
    for kind, backend in BACKENDS.items():
        assert event_medium(kind.value) == backend.event_medium
        assert backend.event_medium in {MEDIUM_CPU, MEDIUM_STORAGE}, kind  # never the pool's own, never a new word


@pytest.mark.parametrize("name", ["CPU", "gpu", "nvme", "", None, TierKind.CPU])
def test_an_unknown_tier_is_refused_by_name(name: object) -> None:
    with pytest.raises(ConfigError, match="unknown tier"):
        event_medium(name)  # type: ignore[arg-type]  # what a caller might pass


def test_a_shared_medium_takes_its_slowest_link() -> None:
    links = medium_links()
    assert set(links) == {MEDIUM_CPU, MEDIUM_STORAGE}
    assert links[MEDIUM_CPU] == BACKENDS[TierKind.CPU].link
    storage = [BACKENDS[k].link for k in (TierKind.DISK, TierKind.REDIS)]
    assert links[MEDIUM_STORAGE] == min(storage, key=lambda link: (link[0], -link[1]))
