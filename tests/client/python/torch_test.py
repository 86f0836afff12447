"""attention_client.torch: a small model whose nn.MultiheadAttention is
swapped for RemoteMultiheadAttention gives the original's output; layers
written by export_model are served."""
import copy
import os
import tempfile
import unittest

import grpc
import torch

import attention_client
from attention_client.torch import RemoteMultiheadAttention, export_model
from server_fixture import Server


class TinyEncoder(torch.nn.Module):
    """An embedding, self-attention with a residual, and a head."""

    def __init__(self, attn, batch_first):
        super().__init__()
        self.embed = torch.nn.Linear(5, 16)
        self.attn = attn
        self.head = torch.nn.Linear(16, 3)
        self.batch_first = batch_first

    def forward(self, x, padding):
        h = self.embed(x)
        a, w = self.attn(h, h, h, key_padding_mask=padding)
        return self.head(h + a), w


def layers():
    torch.manual_seed(0)
    return {
        "enc_seq": torch.nn.MultiheadAttention(16, 4),
        "enc_batch": torch.nn.MultiheadAttention(16, 2, batch_first=True),
        "cross": torch.nn.MultiheadAttention(16, 4, kdim=6, vdim=10, add_bias_kv=True,
                                             add_zero_attn=True),
        "half": torch.nn.MultiheadAttention(16, 4, bias=False).to(torch.bfloat16),
    }


def setUpModule():
    global repository, server, client, LAYERS
    LAYERS = layers()
    repository = tempfile.TemporaryDirectory(prefix="attention_torch_models_")
    for name, layer in LAYERS.items():
        layer.eval()
        export_model(layer, os.path.join(repository.name, name))
    server = Server(repository.name)
    client = attention_client.Client(server.target)
    server.wait_serving(client)


def tearDownModule():
    client.close()
    server.stop()
    repository.cleanup()


class RemoteMultiheadAttentionTest(unittest.TestCase):
    def assertClose(self, got, want, atol=1e-5):
        self.assertEqual(got.shape, want.shape)
        self.assertEqual(got.dtype, want.dtype)
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)

    def swap_and_compare(self, name, batch_first):
        original = TinyEncoder(LAYERS[name], batch_first).eval()
        swapped = copy.deepcopy(original)
        swapped.attn = RemoteMultiheadAttention(None, name, batch_first=batch_first, client=client)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(3, 7, 5, generator=g)  # [B, L, 5]
        padding = torch.zeros(3, 7, dtype=torch.bool)
        padding[1, 5:] = True
        padding[2, 2:] = True
        if not batch_first:
            x = x.transpose(0, 1)
        with torch.no_grad():
            want, want_w = original(x, padding)
            got, got_w = swapped(x, padding)
        self.assertClose(got, want)
        self.assertClose(got_w, want_w)

    def test_swapped_sequence_first_layer_gives_the_original_output(self):
        self.swap_and_compare("enc_seq", batch_first=False)

    def test_swapped_batch_first_layer_gives_the_original_output(self):
        self.swap_and_compare("enc_batch", batch_first=True)

    def test_forward_arguments_as_torch(self):
        layer, remote = LAYERS["cross"], RemoteMultiheadAttention(None, "cross", client=client)
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(4, 2, 16, generator=g), torch.randn(6, 2, 6, generator=g),
                   torch.randn(6, 2, 10, generator=g))
        cases = {
            "plain": {},
            "per-head weights": {"average_attn_weights": False},
            "no weights": {"need_weights": False},
            "bool masks": {"key_padding_mask": torch.tensor([[False] * 5 + [True]] * 2),
                           "attn_mask": torch.rand(4, 6, generator=g) < 0.3},
            "float 3-D mask": {"attn_mask": torch.randn(2 * 4, 4, 6, generator=g)},
        }
        for label, kwargs in cases.items():
            with self.subTest(label), torch.no_grad():
                want, want_w = layer(q, k, v, **kwargs)
                got, got_w = remote(q, k, v, **kwargs)
                self.assertClose(got, want)
                if want_w is None:
                    self.assertIsNone(got_w)
                else:
                    self.assertClose(got_w, want_w)

    def test_causal_and_unbatched_inputs(self):
        layer = LAYERS["enc_batch"]
        remote = RemoteMultiheadAttention(None, "enc_batch", batch_first=True, client=client)
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))  # unbatched [L, E]
        causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
        with torch.no_grad():
            want, want_w = layer(x, x, x, attn_mask=causal, average_attn_weights=False)
            got, got_w = remote(x, x, x, is_causal=True, average_attn_weights=False)
        self.assertClose(got, want)
        self.assertClose(got_w, want_w)

    def test_bfloat16_layer_answers_in_bfloat16(self):
        remote = RemoteMultiheadAttention(None, "half", client=client)
        x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
        with torch.no_grad():
            want, _ = LAYERS["half"].float()(x.float(), x.float(), x.float())
            got, got_w = remote(x, x, x)
        LAYERS["half"].to(torch.bfloat16)
        self.assertEqual((got.dtype, got_w.dtype), (torch.bfloat16, torch.bfloat16))
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)

    def test_attributes_follow_the_served_layer(self):
        remote = RemoteMultiheadAttention(server.target, "cross")
        self.assertEqual((remote.embed_dim, remote.num_heads, remote.kdim, remote.vdim,
                          remote.head_dim, remote.batch_first), (16, 4, 6, 10, 4, False))
        self.assertEqual(list(remote.parameters()), [])
        remote.client.close()

    def test_an_unknown_model_fails_at_construction(self):
        with self.assertRaises(attention_client.AttentionError) as e:
            RemoteMultiheadAttention(None, "nope", client=client)
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn("nope", e.exception.details())

    def test_export_model_writes_the_layers_config(self):
        served = {m.name: m for m in client.models()}
        self.assertEqual(sorted(served), sorted(LAYERS))
        cross = served["cross"]
        self.assertEqual((cross.kdim, cross.vdim, cross.add_bias_kv, cross.add_zero_attn),
                         (6, 10, True, True))
        self.assertFalse(served["half"].bias)


if __name__ == "__main__":
    unittest.main()
