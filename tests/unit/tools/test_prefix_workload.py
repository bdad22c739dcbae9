"""The shared-prefix bench's workloads: what they share, and the unbounded cache's hits."""

from __future__ import annotations

import itertools

import pytest

from scheduler_svc.tools.bench import prefix as W  # noqa: N812 - read as the workloads


def test_session_turns_resend_the_conversation_and_share_system_prompts() -> None:
    requests = W.workload("sessions", rate=8.0, window_s=10.0, seed=0)
    by_session: dict[str, list[W.PrefixRequest]] = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) > W.SYSTEM_PROMPTS  # more sessions than system prompts
    for turns in by_session.values():
        assert len(turns) == W.TURNS
        for earlier, later in itertools.pairwise(turns):
            assert later.prompt[: len(earlier.prompt)] == earlier.prompt  # resent
            assert later.at_s == pytest.approx(earlier.at_s + W.TURN_GAP_S)
    systems = {r.prompt[: W.SYSTEM_TOKENS] for r in requests}
    assert len(systems) <= W.SYSTEM_PROMPTS
    assert [r.at_s for r in requests] == sorted(r.at_s for r in requests)


def test_the_unbounded_cache_serves_every_shared_block_once_seen() -> None:
    sessions = W.workload("sessions", rate=8.0, window_s=10.0, seed=0)
    control = W.workload("control", rate=8.0, window_s=10.0, seed=0)
    fewshot = W.workload("fewshot", rate=8.0, window_s=10.0, seed=0)
    assert W.ideal_reused(control, 16) == 0
    prompt = sum(len(r.prompt) for r in sessions)
    assert 0.8 < W.ideal_reused(sessions, 16) / prompt < 1.0
    # Few-shot: each header's first use misses; later ones reuse its 93 full blocks.
    headers = {r.prompt[: W.FEWSHOT_TOKENS] for r in fewshot}
    assert (
        W.ideal_reused(fewshot, 16) == (len(fewshot) - len(headers)) * (W.FEWSHOT_TOKENS // 16) * 16
    )
    with pytest.raises(ValueError, match="unknown workload"):
        W.workload("nope", 1.0, 1.0, 0)


def test_a_content_seed_changes_the_tokens_and_keeps_the_arrivals() -> None:
    one = W.workload("sessions", rate=8.0, window_s=5.0, seed=3, content_seed=1)
    two = W.workload("sessions", rate=8.0, window_s=5.0, seed=3, content_seed=2)
    assert [(r.at_s, len(r.prompt), r.session) for r in one] == [
        (r.at_s, len(r.prompt), r.session) for r in two
    ]
    assert not {r.prompt[:16] for r in one} & {r.prompt[:16] for r in two}
