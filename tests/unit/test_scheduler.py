"""The scheduler with a fake model: token budget, chunked prefill, preemption, stop rules."""

from __future__ import annotations

import itertools

import numpy as np

from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.protocol.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tokenmill.protocol.lora import LoRAConfig, LoRARequest
from tokenmill.protocol.messages import (
    EngineCoreRequest,
    FinishReason,
    LogprobsArrays,
    SamplingParams,
)
from tokenmill.protocol.scheduler_output import ModelRunnerOutput, SchedulerOutput

EOS = 2


def make_scheduler(
    num_blocks=100,
    block_size=4,
    budget=16,
    max_num_seqs=8,
    chunked=True,
    max_len=256,
    caching=False,
    policy="fcfs",
    max_loras=0,
):
    model = ModelConfig(
        model="fake",
        tokenizer="fake",
        dtype="float32",
        seed=0,
        max_model_len=max_len,
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_kv_heads=1,
        head_size=8,
        max_position_embeddings=max_len,
        eos_token_ids=(EOS,),
    )
    config = EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            policy=policy,
        ),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig(),
        load_config=LoadConfig(),
        lora_config=LoRAConfig(max_loras=max_loras) if max_loras else None,
    )
    return Scheduler(config, num_blocks)


_ids = itertools.count()


def add(
    scheduler: Scheduler,
    prompt_len: int,
    prompt: list[int] | None = None,
    priority: int = 0,
    arrival: float = 0.0,
    lora: LoRARequest | None = None,
    **params,
) -> Request:
    params.setdefault("max_tokens", 100)
    request = Request(
        EngineCoreRequest(
            request_id=f"r{next(_ids)}",
            prompt_token_ids=prompt or list(range(10, 10 + prompt_len)),
            sampling_params=SamplingParams(temperature=0.0, **params),
            eos_token_ids=[EOS],
            arrival_time=arrival,
            priority=priority,
            lora_request=lora,
        ),
        scheduler.max_model_len,
    )
    scheduler.add_request(request)
    return request


def fake_run(scheduler: Scheduler, out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """Samples `token` for every request whose tokens are all computed after this step."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        sampled.append([token] if request.num_computed_tokens >= request.num_tokens else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, fake_run(scheduler, out, token))


def test_budget_is_shared_and_long_prompts_are_chunked() -> None:
    s = make_scheduler(budget=16)
    a, b, c = add(s, 10), add(s, 10), add(s, 10)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {a.request_id: 10, b.request_id: 6}
    assert [r.req_id for r in out.scheduled_new_reqs] == [a.request_id, b.request_id]
    assert a.output_token_ids == [7] and b.output_token_ids == []
    assert out.partial_req_ids == [b.request_id]  # the workers sample for a only
    out, _ = step(s)
    # Running requests first (a decodes, b finishes its prompt), then c fits in the rest.
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 4, c.request_id: 10}
    assert out.partial_req_ids == []
    assert out.scheduled_cached_reqs.req_ids == [a.request_id, b.request_id]
    assert out.total_num_scheduled_tokens == 15
    d = add(s, 20)
    out, _ = step(s)
    # Three decodes take 3 tokens; the new 20-token prompt is cut to the 13 that remain.
    assert out.num_scheduled_tokens == {
        a.request_id: 1,
        b.request_id: 1,
        c.request_id: 1,
        d.request_id: 13,
    }
    assert out.partial_req_ids == [d.request_id]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    s = make_scheduler(budget=16, chunked=False)
    a, b = add(s, 10), add(s, 10)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {a.request_id: 10}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 10}


def test_preemption_frees_the_last_admitted_and_resumes_it() -> None:
    # 5 usable blocks of 4 tokens; two 8-token prompts fill 4 of them.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = add(s, 8), add(s, 8)
    step(s)  # both prefilled; 9 tokens each now
    out, _ = step(s)  # both need a 3rd block: only one is free, so b (admitted last) goes
    assert out.num_scheduled_tokens == {a.request_id: 1}
    assert s.num_preemptions == 1 and b.status == RequestStatus.PREEMPTED
    # The workers learn of it as preempted, not as finished.
    assert out.preempted_req_ids == [b.request_id] and out.finished_req_ids == []
    assert s.waiting.peek() is b and b.num_computed_tokens == 0
    assert s.kv_cache_manager.get_block_ids(b.request_id) == []
    # a finishes; b comes back as a new request carrying the output it already had.
    s.finish_requests([a.request_id], RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    (resumed,) = out.scheduled_new_reqs
    assert resumed.req_id == b.request_id and resumed.output_token_ids == [7]
    assert out.num_scheduled_tokens == {b.request_id: 9}
    assert out.finished_req_ids == [a.request_id] and out.preempted_req_ids == []


def test_stop_rules_and_finish_reasons() -> None:
    s = make_scheduler()
    eos = add(s, 3)
    ignore = add(s, 3, ignore_eos=True, max_tokens=2)
    stop_id = add(s, 3, stop_token_ids=[EOS])
    held = add(s, 3, min_tokens=2)
    _, outputs = step(s, token=EOS)
    by_id = {o.request_id: o for o in outputs.outputs}
    assert by_id[eos.request_id].finish_reason == FinishReason.STOP
    assert by_id[eos.request_id].stop_reason is None
    assert by_id[ignore.request_id].finish_reason is None
    # The EOS check comes first, so a stop id that is also EOS reports as EOS.
    assert by_id[stop_id.request_id].finish_reason == FinishReason.STOP
    assert by_id[held.request_id].finish_reason is None  # min_tokens not reached
    _, outputs = step(s, token=EOS)
    by_id = {o.request_id: o for o in outputs.outputs}
    assert by_id[ignore.request_id].finish_reason == FinishReason.LENGTH
    assert by_id[held.request_id].finish_reason is None  # 2 tokens: still not more than 2
    _, outputs = step(s, token=EOS)
    assert outputs.outputs[0].finish_reason == FinishReason.STOP
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == 99


def test_stop_token_id_sets_stop_reason() -> None:
    s = make_scheduler()
    r = add(s, 3, stop_token_ids=[42])
    step(s, token=5)
    _, outputs = step(s, token=42)
    assert outputs.outputs[0].finish_reason == FinishReason.STOP
    assert outputs.outputs[0].stop_reason == 42 and r.output_token_ids == [5, 42]


def test_max_model_len_caps_generation() -> None:
    s = make_scheduler(max_len=6)
    add(s, 4, max_tokens=None)
    _, o1 = step(s)
    _, o2 = step(s)
    assert o1.outputs[0].finish_reason is None
    assert o2.outputs[0].finish_reason == FinishReason.LENGTH


def test_abort_frees_blocks_and_unknown_ids_are_ignored() -> None:
    s = make_scheduler()
    r = add(s, 10)
    step(s)
    assert s.kv_cache_manager.num_free_blocks < 99
    s.finish_requests([r.request_id, "no-such-id"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == 99 and not s.has_unfinished_requests()
    out = s.schedule()
    assert r.request_id in out.finished_req_ids


def test_priority_policy_admits_and_preempts_by_priority() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, policy="priority")
    low = add(s, 8, priority=5, arrival=0.0)
    high = add(s, 8, priority=1, arrival=1.0)
    out, _ = step(s)
    # Both fit; the more urgent one is admitted and runs first.
    assert [r.req_id for r in out.scheduled_new_reqs] == [high.request_id, low.request_id]
    assert s.running == [high, low]
    out, _ = step(s)  # each needs a third block; one is free: the low-priority one goes
    assert out.num_scheduled_tokens == {high.request_id: 1}
    assert low.status == RequestStatus.PREEMPTED and s.waiting.peek() is low


def test_same_step_prefix_sharing() -> None:
    s = make_scheduler(caching=True, budget=64)
    prompt = list(range(100, 110))
    a, b = add(s, 0, prompt=prompt), add(s, 0, prompt=prompt)
    out, _ = step(s)
    # b shares a's two full blocks, written earlier in the same forward pass.
    assert out.num_scheduled_tokens == {a.request_id: 10, b.request_id: 2}
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    ids_a = s.kv_cache_manager.get_block_ids(a.request_id)
    ids_b = s.kv_cache_manager.get_block_ids(b.request_id)
    assert ids_a[:2] == ids_b[:2] and ids_a[2] != ids_b[2]
    assert s.kv_cache_manager.prefix_cache_queries == 20
    assert s.kv_cache_manager.prefix_cache_hits == 8


def test_fully_cached_prompt_recomputes_its_last_token() -> None:
    s = make_scheduler(caching=True, budget=64)
    prompt = list(range(100, 108))  # exactly two full blocks
    a = add(s, 0, prompt=prompt, max_tokens=1)
    step(s)
    b = add(s, 0, prompt=prompt)
    out, _ = step(s)
    # Only the first block may be a hit: the last token must run to produce logits.
    assert out.num_scheduled_tokens == {b.request_id: 4} and b.num_cached_tokens == 4
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=True)
    a = add(s, 0, prompt=list(range(100, 108)))
    b = add(s, 0, prompt=list(range(200, 208)))
    step(s)
    step(s)  # b is preempted; its two full prompt blocks stay cached in the free queue
    assert b.status == RequestStatus.PREEMPTED
    s.finish_requests([a.request_id], RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    (resumed,) = out.scheduled_new_reqs
    assert resumed.num_computed_tokens == 8  # both prompt blocks reused
    assert out.num_scheduled_tokens == {b.request_id: 1}


def test_reallocated_block_loses_its_hash() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, budget=64, caching=True)
    a = add(s, 0, prompt=list(range(100, 105)), max_tokens=1)
    step(s)  # a finishes; its full block (tokens 100..103) stays cached but free
    pool = s.kv_cache_manager.block_pool
    assert len(pool.cached_blocks) == 1
    # A 12-token prompt takes every free block, evicting the cached one.
    c = add(s, 0, prompt=list(range(300, 312)), max_tokens=1)
    step(s)
    assert c.num_cached_tokens == 0
    d = add(s, 0, prompt=list(range(100, 105)))
    step(s)
    # The old prefix is gone: no stale hit on a block that now holds c's tokens.
    assert d.num_cached_tokens == 0
    hashes = {b.block_hash for b in pool.blocks if b.block_hash is not None}
    assert hashes == set(pool.cached_blocks)
    assert a.status.finished


def test_reset_prefix_cache_is_refused_while_requests_run() -> None:
    s = make_scheduler(caching=True)
    a = add(s, 10, max_tokens=3)
    step(s)
    assert s.reset_prefix_cache() is False
    assert s.kv_cache_manager.block_pool.cached_blocks  # nothing cleared
    while not a.status.finished:
        step(s)
    assert s.reset_prefix_cache() is True
    assert not s.kv_cache_manager.block_pool.cached_blocks


def test_without_prefix_caching_no_lookups_are_recorded() -> None:
    from tokenmill.core.engine_core import spec_line, stats_line

    s = make_scheduler(caching=False)
    add(s, 10)
    add(s, 10, prompt=list(range(10, 20)))
    step(s)
    step(s)
    kv = s.kv_cache_manager
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0
    stats = {"num_running": 2, "num_waiting": 0, "kv_cache_usage": 0.25}
    assert stats_line(10.0, 20.0, stats, None).endswith("prefix caching off")
    assert stats_line(10.0, 20.0, stats, 0.5).endswith("prefix cache hit rate 50.0%")
    # Speculation: 4 verifying steps, 12 proposed tokens, 6 accepted.
    line = spec_line(4, 12, 6)
    assert line == "spec acceptance 50.0%, mean acceptance length 2.50, 4 drafts"
    assert spec_line(0, 0, 0) == "speculation off"
    cached = make_scheduler(caching=True)
    add(cached, 10)
    step(cached)
    assert cached.kv_cache_manager.prefix_cache_queries == 10


def test_async_order_keeps_a_preempted_token_and_drops_work_past_a_stop() -> None:
    """Async scheduling's call order: step N+1 is scheduled before step N's update."""
    # 5 usable blocks of 4 tokens; two 8-token prompts fill 4 of them.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = add(s, 8), add(s, 8)
    out1 = s.schedule()
    run1 = fake_run(s, out1, token=7)
    assert (a.num_output_placeholders, b.num_output_placeholders) == (1, 1)
    # Before step 1's tokens are in, each request's next step is the token it will sample.
    out2 = s.schedule()
    # Both need a 3rd block for it; one is free: b (admitted last) is preempted in flight.
    assert out2.num_scheduled_tokens == {a.request_id: 1}
    assert out2.scheduled_cached_reqs.num_computed_tokens == [8]
    assert b.status == RequestStatus.PREEMPTED and out2.preempted_req_ids == [b.request_id]
    run2 = fake_run(s, out2, token=EOS)
    assert a.num_output_placeholders == 2 and a.num_computed_tokens == 9
    outputs = s.update_from_output(out1, run1).outputs
    # b keeps the token its step sampled before the preemption (vLLM's behaviour).
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [
        (a.request_id, [7]),
        (b.request_id, [7]),
    ]
    assert b.output_token_ids == [7] and b.num_output_placeholders == 0
    assert b.status == RequestStatus.PREEMPTED and s.waiting.peek() is b
    out3 = s.schedule()
    assert out3.num_scheduled_tokens == {a.request_id: 1}  # b does not fit yet
    run3 = fake_run(s, out3, token=9)
    # Step 2 sampled EOS for a: it stops, though step 3 already runs it.
    (stop,) = s.update_from_output(out2, run2).outputs
    assert stop.finish_reason == FinishReason.STOP and a.output_token_ids == [7, EOS]
    assert s.kv_cache_manager.get_block_ids(a.request_id) == []
    out4 = s.schedule()
    (resumed,) = out4.scheduled_new_reqs
    assert resumed.req_id == b.request_id and resumed.output_token_ids == [7]
    assert out4.finished_req_ids == [a.request_id]
    run4 = fake_run(s, out4, token=11)
    # Step 3's token for a is dropped: a has finished.
    assert s.update_from_output(out3, run3).outputs == []
    assert a.output_token_ids == [7, EOS]
    (out,) = s.update_from_output(out4, run4).outputs
    assert out.request_id == b.request_id and b.output_token_ids == [7, 11]


def test_async_order_schedules_nothing_past_max_tokens_and_drops_aborted_tokens() -> None:
    s = make_scheduler()
    one, two, gone = add(s, 3, max_tokens=1), add(s, 3, max_tokens=2), add(s, 3)
    out1 = s.schedule()
    run1 = fake_run(s, out1)
    out2 = s.schedule()
    # `one` gets its only token from step 1: no step 2 for it; `two` still needs one more.
    assert set(out2.num_scheduled_tokens) == {two.request_id, gone.request_id}
    run2 = fake_run(s, out2)
    s.finish_requests([gone.request_id], RequestStatus.FINISHED_ABORTED)
    outputs = s.update_from_output(out1, run1).outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        (one.request_id, FinishReason.LENGTH),
        (two.request_id, None),
    ]
    out3 = s.schedule()
    assert out3.num_scheduled_tokens == {}  # `two`'s last token is in flight
    assert set(out3.finished_req_ids) == {one.request_id, gone.request_id}
    (last,) = s.update_from_output(out2, run2).outputs
    assert last.request_id == two.request_id and last.finish_reason == FinishReason.LENGTH
    assert gone.output_token_ids == [] and not s.has_unfinished_requests()
    s.update_from_output(out3, fake_run(s, out3))
    assert s.kv_cache_manager.num_free_blocks == 99


def _part(rows: int) -> LogprobsArrays:
    """Prompt logprobs for `rows` positions (top 1 after the chosen token)."""
    return LogprobsArrays(
        np.full((rows, 2), 5, dtype=np.int32),
        np.full((rows, 2), -1.0, dtype=np.float32),
        np.ones(rows, dtype=np.int32),
    )


def test_async_order_prompt_logprobs_of_a_request_preempted_in_flight() -> None:
    # Its prompt's last chunk is in flight: the token and all the prompt logprobs are kept.
    s = make_scheduler(num_blocks=7, block_size=4, budget=12)
    x, a = add(s, 8), add(s, 12, prompt_logprobs=1)
    out1 = s.schedule()
    run1 = fake_run(s, out1)
    run1.prompt_logprobs = {a.request_id: _part(4)}  # positions 1-4
    out2 = s.schedule()
    assert out2.num_scheduled_tokens == {x.request_id: 1, a.request_id: 8}
    run2 = fake_run(s, out2)
    run2.prompt_logprobs = {a.request_id: _part(7)}  # positions 5-11
    s.update_from_output(out1, run1)
    out3 = s.schedule()  # a's pending token needs a 4th block: none is left
    assert a.status == RequestStatus.PREEMPTED and out3.num_scheduled_tokens == {x.request_id: 1}
    assert len(a.prompt_logprob_parts) == 1  # kept for the step in flight
    (_, kept) = s.update_from_output(out2, run2).outputs
    assert kept.request_id == a.request_id and kept.new_token_ids == [7]
    assert kept.prompt_logprobs is not None and len(kept.prompt_logprobs.ranks) == 11
    assert a.prompt_logprobs_sent and a.prompt_logprob_parts == []

    # Mid-prompt when preempted: that chunk's logprobs are dropped (the prompt is recomputed).
    s = make_scheduler(num_blocks=6, block_size=4, budget=12)
    x, a = add(s, 8), add(s, 12, prompt_logprobs=1)
    out1 = s.schedule()
    assert out1.num_scheduled_tokens == {x.request_id: 8, a.request_id: 4}
    run1 = fake_run(s, out1)
    run1.prompt_logprobs = {a.request_id: _part(4)}
    s.schedule()  # a's next chunk needs two more blocks; one is left after x's decode
    assert a.status == RequestStatus.PREEMPTED and a.num_output_placeholders == 0
    outputs = s.update_from_output(out1, run1).outputs
    assert [o.request_id for o in outputs] == [x.request_id]
    assert a.prompt_logprob_parts == [] and not a.prompt_logprobs_sent


def test_a_step_runs_at_most_max_loras_adapters() -> None:
    """With one adapter slot, a waiting request of another adapter is held back (in its
    place in the queue, behind no one it overtook) until the running adapter's requests end;
    base-model requests and more requests of the running adapter pass it."""
    scheduler = make_scheduler(budget=64, max_loras=1)
    one, two = LoRARequest("one", 1, "/a"), LoRARequest("two", 2, "/b")
    a = add(scheduler, 4, lora=one)
    b = add(scheduler, 4, lora=two)
    c = add(scheduler, 4, lora=one)
    d = add(scheduler, 4)
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {a.request_id, c.request_id, d.request_id}
    assert [r.lora_request for r in out.scheduled_new_reqs] == [one, one, None]
    assert [r.request_id for r in scheduler.waiting] == [b.request_id]
    assert scheduler.lora_counts() == ({"one": 2}, {"two": 1})
    scheduler.update_from_output(out, fake_run(scheduler, out))
    scheduler.finish_requests([a.request_id, c.request_id], RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    assert b.request_id in out.num_scheduled_tokens
    assert scheduler.running_adapters() == {2}
