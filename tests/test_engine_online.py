"""The online interface: add_request at any time, step() reports each new token, abort() frees a request."""
import pytest
from conftest import ENGINE_MODEL, check_tables, drive, greedy_reference, workload

from minillm.engine import Engine, EngineConfig, Request, StepOutput


def make(**settings) -> Engine:
    return Engine(ENGINE_MODEL, EngineConfig(**settings))


def test_requests_added_between_steps_stream_the_tokens_of_generate_alone():
    requests = workload(6, seed=7, max_tokens=10)
    engine = make(max_batch_size=3, max_num_batched_tokens=8)
    assert engine.step().outputs == [] and not engine.has_unfinished()
    outputs, records = drive(engine, {0: requests[:2], 2: requests[2:3], 5: requests[3:]})
    assert not engine.has_unfinished() and engine.step().outputs == []
    for request in requests:
        outs = outputs[request.request_id]
        assert all(isinstance(o, StepOutput) and len(o.new_token_ids) == 1 for o in outs)
        assert [o.new_token_ids[0] for o in outs] == greedy_reference(tuple(request.prompt_ids))[:request.max_tokens]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert [o.finish_reason for o in outs] == [None] * (len(outs) - 1) + ["max_tokens"]
        times = [o.time for o in outs]
        assert times == sorted(times) and times[-1] <= engine.clock()
    assert sum(len(v) for v in outputs.values()) == sum(r.n_sampled for r in records)


def test_run_is_the_same_loop():
    requests = workload(5, seed=8, max_tokens=6)
    engine = make(max_batch_size=2)
    outputs, _ = drive(engine, {0: requests})
    result = engine.run(requests)  # the engine is idle again, so it can run a workload
    assert [r.output_ids for r in result.requests] == [
        [t for o in outputs[r.request_id] for t in o.new_token_ids] for r in requests]


def test_eos_is_reported_as_the_finish_reason():
    prompt = [5, 6, 7]
    eos = greedy_reference(tuple(prompt))[2]
    engine = make(eos_token_id=eos)
    outputs, _ = drive(engine, {0: [Request("r", prompt, 10)]})
    last = outputs["r"][-1]
    assert last.finished and last.finish_reason == "eos" and last.new_token_ids == [eos]


@pytest.mark.parametrize("caching", [False, True])
def test_abort_frees_a_waiting_or_running_request_at_once(caching):
    """Two slots: a and c run, b waits. Aborting b drops it from the queue; aborting a mid-decode frees its
    blocks at once (shared prefix blocks stay with whoever still holds them)."""
    prefix = list(range(60, 76))
    a, b, c = (Request(name, prefix + [i], 20) for i, name in enumerate("abc"))
    engine = make(max_batch_size=2, block_size=4, enable_prefix_caching=caching)
    engine.add_request(a)
    engine.step()
    engine.add_request(c)
    first = engine.step().outputs  # c runs beside a (sharing a's 4 prefix blocks when caching)
    engine.add_request(b)  # no slot: b waits
    assert engine.abort("b").status == "aborted" and not engine.scheduler.waiting
    held = len(engine.scheduler.requests["a"].block_table)
    used = engine.blocks.num_used
    assert engine.abort("a").output_ids == greedy_reference(tuple(a.prompt_ids))[:2]
    assert engine.blocks.num_used == used - (held - 4 if caching else held)
    check_tables(engine)
    assert engine.abort("a") is engine.abort("b") is engine.abort("unknown") is None
    tokens = [o.new_token_ids[0] for o in first if o.request_id == "c"]
    while engine.has_unfinished():
        for o in engine.step().outputs:
            assert o.request_id == "c"
            tokens += o.new_token_ids
        check_tables(engine)
    assert tokens == greedy_reference(tuple(c.prompt_ids))[:20]
    assert engine.blocks.ref_counts == [0] * engine.blocks.num_blocks


def test_add_request_checks_its_argument():
    engine = make(num_blocks=2, block_size=8)
    engine.add_request(Request("x", [1, 2], 3))
    with pytest.raises(ValueError, match="request_id 'x' is already waiting or running"):
        engine.add_request(Request("x", [3], 3))
    with pytest.raises(ValueError, match="'big' rejected: needs 3 KV blocks of 8 tokens"):
        engine.add_request(Request("big", [1] * 16, 2))
    with pytest.raises(ValueError, match="'empty' rejected: empty prompt"):
        engine.add_request(Request("empty", [], 2))
    with pytest.raises(TypeError, match="request must be a Request, got dict"):
        engine.add_request({"prompt_ids": [1]})
    with pytest.raises(RuntimeError, match="still holding requests"):
        engine.run([Request("y", [1], 1)])
    while engine.has_unfinished():
        engine.step()
    engine.add_request(Request("x", [3], 3))  # a finished request's id can be used again
    assert engine.has_unfinished()
