"""Block-hash contract: pinned known-answer vectors and an independent re-derivation
from the byte-exact spec in ``pagoda.contracts.block_hash``'s docstring."""

import hashlib
import struct

import pytest

from pagoda.contracts.block_hash import encode_extra_keys, hash_block, hash_prompt_blocks, root_hash

MODEL = "test-model"

# Pinned when the contract was written; the Redis index and routers depend on them.
ROOT = "b82f49f413ed42b7100539947e9a24c0e6c2a86599434a01fe2b6925105cf269"
BLOCK_1234 = "a857aaa1855a797e23c0cd2a1bf6ccba63743b35ba2ad92b6c845da345231ca2"
CHAIN_0_TO_7 = [
    "500f5c041ba86d3ddbfbb1ddf150874030100fb01811dbc892b2172e820500d8",
    "9da5a5d1ec69e975ba71c04a2f84fdead79db01a9c3159fb398472ead5edfa24",
]
CHAIN_SALTED = [
    "9c692664591393517f1446a45cb51e1fa93ebc675790c4652889b12fb65e88d6",
    "faa39e54118f49e4770fcd2a4a1b83dd8c799b8ad02b92611e1bc8d8d75fc422",
]
CHAIN_SALTED_ADAPTER = [
    "780dfdf9ff5e5f8d1cc3f5421c55123ad33a27367f3086664d1417f17c814170",
    "5826bdd07d102e0d53f2430954cbc2f4797884e7f3efb1da36585f173cba035d",
]


def _spec_block(parent: bytes, tokens: list[int], extra: bytes) -> bytes:
    data = b"pagoda-block-v1" + parent + struct.pack("<I", len(tokens))
    data += b"".join(struct.pack("<I", t) for t in tokens)
    data += struct.pack("<I", len(extra)) + extra
    return hashlib.sha256(data).digest()


def test_known_answer_vectors():
    assert root_hash(MODEL).hex() == ROOT
    assert hash_block(root_hash(MODEL), [1, 2, 3, 4]).hex() == BLOCK_1234
    assert [h.hex() for h in hash_prompt_blocks(list(range(8)), 4, MODEL)] == CHAIN_0_TO_7
    assert [h.hex() for h in hash_prompt_blocks(list(range(8)), 4, MODEL, cache_salt="tenant-a")] == CHAIN_SALTED
    salted = hash_prompt_blocks(list(range(8)), 4, MODEL, cache_salt="tenant-a", adapter_id="lora1")
    assert [h.hex() for h in salted] == CHAIN_SALTED_ADAPTER


def test_matches_independent_derivation_from_spec():
    root = hashlib.sha256(b"pagoda-root-v1" + MODEL.encode()).digest()
    assert root.hex() == ROOT
    extra = b'{"adapter":"lora1","salt":"tenant-a"}'
    assert encode_extra_keys("tenant-a", "lora1") == extra
    h0 = _spec_block(root, [0, 1, 2, 3], extra)
    h1 = _spec_block(h0, [4, 5, 6, 7], extra)
    assert [h0.hex(), h1.hex()] == CHAIN_SALTED_ADAPTER
    assert _spec_block(root, [0, 1, 2, 3], b"").hex() == CHAIN_0_TO_7[0]


def test_chain_property_and_partial_blocks():
    tokens = list(range(100, 111))  # 2 full blocks of 4 + 3 trailing tokens
    hashes = hash_prompt_blocks(tokens, 4, MODEL)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(root_hash(MODEL), tokens[:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    # Continuing a chain from a parent equals hashing the whole prefix at once.
    assert hash_prompt_blocks(tokens[4:8], 4, MODEL, parent=hashes[0]) == hashes[1:]
    # Same block content under a different prefix hashes differently.
    other = hash_prompt_blocks([9, 9, 9, 9] + tokens[4:8], 4, MODEL)
    assert other[1] != hashes[1]


@pytest.mark.parametrize(
    "kwargs",
    [{"cache_salt": "a"}, {"cache_salt": "b"}, {"adapter_id": "x"}, {"cache_salt": "a", "adapter_id": "x"}],
)
def test_extra_keys_change_every_block(kwargs):
    tokens = list(range(16))
    plain = hash_prompt_blocks(tokens, 4, MODEL)
    keyed = hash_prompt_blocks(tokens, 4, MODEL, **kwargs)
    assert all(p != k for p, k in zip(plain, keyed))


def test_model_id_and_salt_isolation():
    tokens = list(range(8))
    assert hash_prompt_blocks(tokens, 4, "m1") != hash_prompt_blocks(tokens, 4, "m2")
    assert hash_prompt_blocks(tokens, 4, MODEL, cache_salt="a") != hash_prompt_blocks(tokens, 4, MODEL, cache_salt="b")
    assert encode_extra_keys() == b""


def test_image_keys_enter_only_the_blocks_that_overlap_the_image():
    """``mm`` extra keys (the module docstring's byte form): the blocks that overlap an image's
    placeholders carry its content hash and offset; the blocks before it stay as plain text."""
    from pagoda.engine.multimodal import MultiModalFeature
    from pagoda.engine.request import Request
    from pagoda.engine.sampling_params import SamplingParams

    assert encode_extra_keys("t", None, [("ab12", 5)]) == b'{"mm":[["ab12",5]],"salt":"t"}'
    tokens = list(range(4)) + [7] + [99] * 6 + list(range(20, 25))  # an image at 5..10, 16 tokens

    def hashes(mm_hash: str) -> list:
        request = Request("r", tokens, SamplingParams(), mm_features=(MultiModalFeature(mm_hash, 5, 6),))
        request.init_block_hashes(4, MODEL)
        return request.block_hashes

    plain = hash_prompt_blocks(tokens, 4, MODEL)
    first, same, other = hashes("aa"), hashes("aa"), hashes("bb")
    assert first == same and first[0] == other[0] == plain[0]  # block 0 (tokens 0..3) ends before the image
    assert all(a != b for a, b in zip(first[1:], other[1:]))  # blocks 1, 2 overlap it; block 3 chains after
    root = root_hash(MODEL)
    extra = encode_extra_keys(mm_keys=[("aa", 5)])
    assert first[1] == hash_block(hash_block(root, tokens[:4]), tokens[4:8], extra)
    assert first[3] == hash_block(first[2], tokens[12:16])  # past the image: no image key, but its chain
    assert hash_prompt_blocks(tokens, 4, MODEL, mm_spans=[("aa", 5, 6)]) == first  # the router's form, same hashes
    assert hash_prompt_blocks(tokens, 4, MODEL, mm_spans=[("bb", 5, 6)]) == other
