"""generate(stream=...) hands over exactly the committed tokens, in order, for plain and speculative decoding."""

import numpy as np
import pytest

import qwen_mtp


@pytest.fixture(scope="module")
def model(ckpt):
    return qwen_mtp.load(ckpt("dense_mtp")[1])


@pytest.mark.parametrize("spec", [None, qwen_mtp.SpecConfig(k=3), qwen_mtp.SpecConfig(k=2, window=4, sinks=1)])
def test_stream_delivers_the_result(model, spec):
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 97, 9), rng.randint(0, 97, 30)]
    got = [[], []]
    calls = []

    def sink(rows):
        calls.append([len(r) for r in rows])
        for b, r in enumerate(rows):
            got[b].extend(int(t) for t in r)

    res = qwen_mtp.generate(model, prompts, 20, spec=spec, eos_token_id=[], stream=sink)
    for b in range(2):
        assert got[b] == res.tokens[b, :res.lengths[b]].tolist()
    assert len(calls) > 1  # delivered while decoding, not once at the end
    ref = qwen_mtp.generate(model, prompts, 20, spec=spec, eos_token_id=[])
    np.testing.assert_array_equal(ref.tokens, res.tokens)


def test_stream_must_be_callable(model):
    with pytest.raises(qwen_mtp.ArgumentError, match="stream"):
        qwen_mtp.generate(model, [1, 2, 3], 4, stream="print")
