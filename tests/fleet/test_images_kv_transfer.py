"""Image prompts and KV transfers: refused explicitly, never silently wrong.

The blocks that overlap an image are hashed with its content (``mm`` extra keys); KV transfers
name and verify blocks by their token ids and salt/adapter only. So: an offer of an image
prompt's blocks fails the receiver's rehash (``check_offer``), a replica refuses an image
prompt with ``kv_transfer_params`` naming the field, and the router runs an image request in
one stage, without a peer pull.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagoda.contracts.request_options import RequestOptions
from pagoda.engine.kv_transfer.offer import Offer, check_offer
from pagoda.engine.multimodal import MultiModalFeature
from pagoda.engine.request import Request
from pagoda.engine.sampling_params import SamplingParams
from pagoda.fleet.api.routed_request import RoutedRequest
from pagoda.fleet.api.upstream import GrpcUpstream
from pagoda.serving.kv_transfer_control import KVTransferControl
from pagoda.serving.wire import WireRequest

LAYOUT = {"dtype": "float32"}


def test_an_offer_of_blocks_that_overlap_an_image_is_refused_by_the_rehash():
    tokens = list(range(4)) + [7] * 6 + list(range(20, 25))  # an image's placeholders at 4..9
    request = Request("r", tokens, SamplingParams(), mm_features=(MultiModalFeature("aa" * 32, 4, 6),))
    request.init_block_hashes(4, "m")
    blocks = [tokens[i:i + 4] for i in range(0, 12, 4)]
    text_only = Offer("t", "m", 4, LAYOUT, request.block_hashes[:1], blocks[:1])
    assert check_offer(text_only, "m", 4, LAYOUT) is None  # the block before the image is plain text
    offer = Offer("t", "m", 4, LAYOUT, request.block_hashes[:3], blocks)
    assert "block 1's hash" in check_offer(offer, "m", 4, LAYOUT)


@pytest.mark.parametrize("params", [{"do_remote_decode": True},
                                    {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1}])
def test_a_replica_refuses_an_image_prompt_with_kv_transfer_params(params):
    control = KVTransferControl(SimpleNamespace(), connector=object())
    with pytest.raises(ValueError, match="kv_transfer_params: prompts with images do not take part"):
        control.check(params, has_images=True)
    control.check(params, has_images=False)  # text prompts transfer as before
    control.check(None, has_images=True)


def test_the_router_runs_an_image_request_in_one_stage_without_a_peer_pull():
    replicas = [SimpleNamespace(role="prefill", replica_id="p"), SimpleNamespace(role="decode", replica_id="d")]
    router = SimpleNamespace(replicas=SimpleNamespace(routable=lambda *a, **k: replicas, all=lambda: replicas))
    upstream = GrpcUpstream(router, None)
    text = WireRequest(prompt_token_ids=(1, 2, 3), params=SamplingParams(), options=RequestOptions())
    image = WireRequest(prompt_token_ids=(1, 2, 3), params=SamplingParams(), options=RequestOptions(),
                        images=(b"\x89PNG...",))
    assert upstream._is_disaggregated(RoutedRequest("a", text))
    assert not upstream._is_disaggregated(RoutedRequest("b", image))
    assert upstream._may_pull(RoutedRequest("a", text)) and not upstream._may_pull(RoutedRequest("b", image))
