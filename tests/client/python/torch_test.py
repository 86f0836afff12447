"""attention_client.torch: a small model whose nn.MultiheadAttention is
swapped for RemoteMultiheadAttention gives the original's output; layers
written by export_model are served."""
import copy
import importlib.util
import io
import itertools
import os
import pickle
import tempfile
import unittest
import unittest.mock
import warnings

import grpc
import torch

import attention_client
from attention_client.torch import RemoteMultiheadAttention, export_model
from server_fixture import MODELS_DIR, Server


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

    def assertSameAnswer(self, got, want):
        """(output, weights) pairs as nn.MultiheadAttention returns them."""
        self.assertClose(got[0], want[0])
        if want[1] is None:
            self.assertIsNone(got[1])
        else:
            self.assertClose(got[1], want[1])

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

    def encoder_layer(self):
        """A batch_first TransformerEncoderLayer around LAYERS["enc_batch"]'s weights."""
        torch.manual_seed(5)
        layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
        layer.self_attn.load_state_dict(LAYERS["enc_batch"].state_dict())
        return layer.eval()

    def test_transformer_encoder_layers_in_eval_mode_call_forward(self):
        # In eval mode under no_grad, torch's encoder takes its fused fast path
        # unless self_attn says it cannot (_qkv_same_embed_dim False); the
        # remote layer has no projection weights to read.
        local = self.encoder_layer()
        remote = copy.deepcopy(local)
        remote.self_attn = RemoteMultiheadAttention(None, "enc_batch", batch_first=True,
                                                    client=client)
        local_encoder = torch.nn.TransformerEncoder(self.encoder_layer(), 2).eval()
        remote_encoder = copy.deepcopy(local_encoder)
        for layer in remote_encoder.layers:
            layer.self_attn = RemoteMultiheadAttention(None, "enc_batch", batch_first=True,
                                                       client=client)
        g = torch.Generator().manual_seed(6)
        x = torch.randn(3, 7, 16, generator=g)
        padding = torch.zeros(3, 7, dtype=torch.bool)
        padding[1, 5:] = True
        padding[2, 2:] = True
        with torch.no_grad():
            self.assertClose(remote(x), local(x))
            self.assertClose(remote(x, src_key_padding_mask=padding),
                             local(x, src_key_padding_mask=padding))
            self.assertClose(remote_encoder(x), local_encoder(x))
            # torch's fast path pads the rows of padded positions with zeros.
            got = remote_encoder(x, src_key_padding_mask=padding)
            with warnings.catch_warnings():  # "nested tensors are in prototype stage"
                warnings.simplefilter("ignore", UserWarning)
                want = local_encoder(x, src_key_padding_mask=padding)
            self.assertClose(got[~padding], want[~padding])
        self.assertIsNone(remote.self_attn.in_proj_weight)
        self.assertFalse(remote.self_attn._qkv_same_embed_dim)

    def test_copies_share_the_client_and_make_a_transformer_decoder(self):
        remote = RemoteMultiheadAttention(None, "enc_batch", batch_first=True, client=client)
        twin = copy.deepcopy(remote)
        self.assertIsNot(twin, remote)
        self.assertIs(twin.client, client)
        self.assertEqual((twin.model, twin.embed_dim, twin.num_heads, twin.batch_first),
                         ("enc_batch", 16, 2, True))
        # nn.TransformerDecoder deep-copies its layer num_layers times.
        torch.manual_seed(7)
        local_layer = torch.nn.TransformerDecoderLayer(16, 2, dim_feedforward=32,
                                                       batch_first=True)
        local_layer.self_attn.load_state_dict(LAYERS["enc_batch"].state_dict())
        local_layer.multihead_attn.load_state_dict(LAYERS["enc_batch"].state_dict())
        remote_layer = copy.deepcopy(local_layer)
        remote_layer.self_attn = remote
        remote_layer.multihead_attn = RemoteMultiheadAttention(None, "enc_batch",
                                                               batch_first=True, client=client)
        local = torch.nn.TransformerDecoder(local_layer, 2).eval()
        swapped = torch.nn.TransformerDecoder(remote_layer, 2).eval()
        self.assertEqual({layer.self_attn.client for layer in swapped.layers}, {client})
        g = torch.Generator().manual_seed(8)
        tgt, memory = torch.randn(3, 5, 16, generator=g), torch.randn(3, 7, 16, generator=g)
        causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
        padding = torch.zeros(3, 7, dtype=torch.bool)
        padding[1, 4:] = True
        with torch.no_grad():
            self.assertClose(swapped(tgt, memory, tgt_mask=causal,
                                     memory_key_padding_mask=padding),
                             local(tgt, memory, tgt_mask=causal, memory_key_padding_mask=padding))

    def test_a_client_with_tls_but_no_ca_does_not_pickle(self):
        # TLS on the system's roots (and any client certificate, which is not
        # saved): loaded, the client would not use TLS at all.
        remote = RemoteMultiheadAttention(server.target, "cross", batch_first=True)
        remote.client.close()
        remote.client = attention_client.Client(server.target, tls_server_name="localhost")
        with self.assertRaises(attention_client.AttentionError) as e:
            pickle.dumps(remote)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("TLS without tls_ca", e.exception.details())
        remote.client.close()

    def test_torch_save_and_load_make_a_client_to_the_same_target(self):
        remote = RemoteMultiheadAttention(server.target, "cross", batch_first=True)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16))
        model.attn = remote
        saved = io.BytesIO()
        torch.save(model, saved)
        remote.client.close()
        saved.seek(0)
        loaded = torch.load(saved).attn
        self.assertIsInstance(loaded.client, attention_client.Client)
        self.assertIsNot(loaded.client, remote.client)
        self.assertEqual((loaded.model, loaded.kdim, loaded.vdim, loaded.batch_first),
                         ("cross", 6, 10, True))
        g = torch.Generator().manual_seed(9)
        q, k = torch.randn(2, 4, 16, generator=g), torch.randn(2, 6, 6, generator=g)
        v = torch.randn(2, 6, 10, generator=g)
        layer = copy.deepcopy(LAYERS["cross"])
        layer.batch_first = True
        with torch.no_grad():
            got, got_w = loaded(q, k, v)
            want, want_w = layer(q, k, v)
        self.assertClose(got, want)
        self.assertClose(got_w, want_w)
        loaded.client.close()
        # A client's token is not written into the saved layer.
        with attention_client.Client(server.target, token="s3cret-token") as with_token:
            saved = pickle.dumps(RemoteMultiheadAttention(None, "cross", client=with_token))
        self.assertNotIn(b"s3cret-token", saved)
        self.assertEqual(pickle.loads(saved).client._settings.metadata, None)

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
                self.assertSameAnswer(remote(q, k, v, **kwargs), layer(q, k, v, **kwargs))

    def test_a_3d_attn_mask_of_the_wrong_size_is_invalid_argument(self):
        remote = RemoteMultiheadAttention(None, "enc_seq", client=client)
        x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(10))  # [L, B, E]
        with self.assertRaises(attention_client.AttentionError) as e:
            remote(x, x, x, attn_mask=torch.zeros(3 * 4, 4, 4))
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("attn_mask: 3-D shape [12, 4, 4] is not [batch * num_heads, L, S] with "
                      "batch * num_heads = 2 * 4 = 8", e.exception.details())

    def test_empty_inputs_get_torchs_answer(self):
        # nn.MultiheadAttention answers inputs with no query, key or batch row,
        # which the server refuses ("every dim must be >= 1"). No query or
        # batch row: computed here, nothing sent. No key: out_proj's bias, or
        # with "cross" the answer over bias_k and the zero key, whose weights
        # are the server's: one call.
        g = torch.Generator().manual_seed(11)
        for name in ("enc_seq", "enc_batch", "cross"):
            layer = LAYERS[name]
            remote = RemoteMultiheadAttention(None, name, batch_first=layer.batch_first,
                                              client=client)
            for (lq, s, b), batched in itertools.product(
                    [(0, 3, 2), (3, 0, 2), (3, 3, 0), (0, 0, 2)], (True, False)):
                if not batched and b == 0:
                    continue

                def inputs(rows, dim):
                    shape = [rows, b, dim] if batched else [rows, dim]
                    if batched and layer.batch_first:
                        shape[:2] = shape[1::-1]
                    return torch.randn(shape, generator=g)
                q, k, v = inputs(lq, 16), inputs(s, layer.kdim), inputs(s, layer.vdim)
                masks = {"key_padding_mask": torch.zeros([b, s] if batched else [s],
                                                         dtype=torch.bool),
                         "attn_mask": torch.zeros(b * layer.num_heads if batched else
                                                  layer.num_heads, lq, s)}
                for kwargs in ({}, {"average_attn_weights": False}, {"need_weights": False},
                               masks):
                    with self.subTest(name, L=lq, S=s, B=b, batched=batched, **kwargs), \
                            torch.no_grad(), unittest.mock.patch.object(
                                client, "attend", wraps=client.attend) as attend:
                        self.assertSameAnswer(remote(q, k, v, **kwargs),
                                              layer(q, k, v, **kwargs))
                        self.assertEqual(attend.call_count, int(lq > 0 and b > 0))
        remote = RemoteMultiheadAttention(None, "enc_seq", client=client)
        q = torch.zeros(0, 2, 16, dtype=torch.bfloat16)
        got, got_w = remote(q, q, q, average_attn_weights=False)
        self.assertEqual((got.dtype, tuple(got.shape), tuple(got_w.shape)),
                         (torch.bfloat16, (0, 2, 16), (2, 4, 0, 0)))
        # torch's checks hold for them too.
        with self.assertRaises(attention_client.AttentionError) as e:
            remote(q, q, q, key_padding_mask=torch.zeros(2, 1, dtype=torch.bool))
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("key_padding_mask", e.exception.details())

    def test_inputs_of_other_ranks_than_torch_takes_are_invalid_argument(self):
        # Anything but a 2-D query was taken for an unbatched one: a 4-D query
        # was refused as "rank 5", a 3-D key with a 2-D query went unnoticed,
        # and a 0-D query raised IndexError.
        remote = RemoteMultiheadAttention(None, "enc_seq", client=client)
        x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(12))
        cases = [
            ((x[None], x, x), {}, "query: shape [1, 4, 2, 16] is 4-D; want 3-D (batched) or "
                                  "2-D (unbatched)"),
            ((torch.tensor(1.0), x, x), {}, "query: shape [] is 0-D"),
            ((x[:, 0], x, x[:, 0]), {}, "key: shape [4, 2, 16] is 3-D; want 2-D with the "
                                        "unbatched query [4, 16]"),
            ((x, x, x[:, 0]), {}, "value: shape [4, 16] is 2-D; want 3-D with the batched "
                                  "query [4, 2, 16]"),
            ((x, x, x), {"key_padding_mask": torch.zeros(4, dtype=torch.bool)},
             "key_padding_mask: shape [4] is 1-D; want 2-D with the batched query"),
            ((x, x, x), {"attn_mask": torch.zeros(8, 5, 4)},
             "attn_mask: 3-D shape [8, 5, 4] is not [batch * num_heads, L, S] with batch * "
             "num_heads = 2 * 4 = 8, L = 4 and S = 4"),
        ]
        for args, kwargs, text in cases:
            with self.subTest(text):
                with self.assertRaises(attention_client.AttentionError) as e:
                    remote(*args, **kwargs)
                self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn(text, e.exception.details())

    def test_inputs_torch_refuses_are_invalid_argument(self):
        # The wire broadcasts a batch of 1 and takes 4-D masks and any float
        # dtype; torch's layer refuses them, and so does the module, before a
        # call: a query batch of 1 came back with the key's batch of 2, and
        # float64 was rounded through float32. With L of 0 the dtypes went
        # unchecked.
        layer = LAYERS["enc_seq"]
        remote = RemoteMultiheadAttention(None, "enc_seq", client=client)
        g = torch.Generator().manual_seed(13)
        q, kv = torch.randn(3, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
        none = torch.zeros(0, 2, 16)
        cases = [
            ((q[:, :1], kv, kv), {}, "key: batch 2 (shape [4, 2, 16]) is not the query's 1 "
                                     "(shape [3, 1, 16])"),
            ((q, kv[:, :1], kv[:, :1]), {}, "key: batch 1 (shape [4, 1, 16]) is not the "
                                            "query's 2"),
            ((q, kv, kv), {"key_padding_mask": torch.zeros(1, 4, dtype=torch.bool)},
             "expecting key_padding_mask shape of (2, 4)"),
            ((q, kv, kv), {"attn_mask": torch.zeros(1, 4)}, "2D attn_mask is torch.Size([1, 4])"),
            ((q, kv, kv), {"attn_mask": torch.zeros(2, 4, 3, 4)}, "found 4-D tensor"),
            ((q[:, 0], kv[:, 0], kv[:, 0]), {"attn_mask": torch.zeros(1, 4, 3, 4)},
             "found 4-D tensor"),
            ((q.double(), kv.double(), kv.double()), {},
             "query: dtype torch.float64 is not torch.float32, torch.bfloat16 or torch.float16"),
            ((q, kv.double(), kv), {}, "key: dtype torch.float64 is not the query's "
                                       "torch.float32"),
            ((q, kv, kv.half()), {}, "value: dtype torch.float16 is not the query's"),
            ((none.long(), kv.long(), kv.long()), {}, "query: dtype torch.int64 is not"),
            ((none, kv, kv), {"key_padding_mask": torch.zeros(2, 4, dtype=torch.int64)},
             "only bool and floating types of key_padding_mask"),
        ]
        for args, kwargs, text in cases:
            with self.subTest(text), unittest.mock.patch.object(
                    client, "attend", wraps=client.attend) as attend:
                with self.assertRaises(Exception, msg="torch's own layer answers"):
                    layer(*args, **kwargs)
                with self.assertRaises(attention_client.AttentionError) as e:
                    remote(*args, **kwargs)
                self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn(text, e.exception.details())
                self.assertEqual(attend.call_count, 0)

    def test_meta_tensors_get_torchs_answer_on_meta_without_a_call(self):
        layer = copy.deepcopy(LAYERS["cross"]).to("meta")
        remote = RemoteMultiheadAttention(None, "cross", client=client)
        q, k, v = (torch.empty(4, 2, 16, device="meta"), torch.empty(6, 2, 6, device="meta"),
                   torch.empty(6, 2, 10, device="meta"))
        with unittest.mock.patch.object(client, "attend", wraps=client.attend) as attend:
            for kwargs in ({}, {"average_attn_weights": False}, {"need_weights": False}):
                with self.subTest(**kwargs):
                    want, got = layer(q, k, v, **kwargs), remote(q, k, v, **kwargs)
                    for g, w in zip(got, want):
                        self.assertEqual(None if g is None else (g.shape, g.dtype, g.device),
                                         None if w is None else (w.shape, w.dtype, w.device))
        self.assertEqual(attend.call_count, 0)

    def test_torchs_checks_run_once_per_shapes_dtypes_and_flags(self):
        remote = RemoteMultiheadAttention(None, "enc_seq", client=client)
        x, y = torch.randn(3, 2, 16), torch.randn(5, 2, 16)
        with unittest.mock.patch.object(remote, "_on_meta", wraps=remote._on_meta) as checks:
            for _ in range(3):
                remote(x, x, x)
                remote(y, y, y)
                remote(y, y, y, need_weights=False)
                with self.assertRaises(attention_client.AttentionError):
                    remote(x, x, x, attn_mask=torch.zeros(3, 3, 1, 1))
        self.assertEqual(checks.call_count, 4)
        self.assertEqual(pickle.loads(pickle.dumps(remote))._checked, {})

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

    def test_export_refuses_a_name_other_than_the_folders(self):
        # The server refuses to start on a model whose config.pbtxt names
        # another than its folder ('name "layer_a" does not match its folder
        # "folder_a"'); both exporters used to write such a name.
        spec = importlib.util.spec_from_file_location(
            "export_model", os.path.join(MODELS_DIR, "export_model.py"))
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        with tempfile.TemporaryDirectory() as parent:
            folder = os.path.join(parent, "folder_a")
            with self.assertRaises(attention_client.AttentionError) as e:
                export_model(LAYERS["enc_seq"], folder, name="layer_a")
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn('name "layer_a" does not match its folder "folder_a"',
                          e.exception.details())
            with self.assertRaises(ValueError) as e:
                script.export(LAYERS["enc_seq"], folder, name="layer_a")
            self.assertIn('name "layer_a" does not match its folder "folder_a"',
                          str(e.exception))
            self.assertFalse(os.path.exists(folder))
            self.assertEqual(export_model(LAYERS["enc_seq"], folder + "/", name="folder_a").name,
                             "folder_a")
            script.export(LAYERS["enc_seq"], os.path.join(parent, "script_a"), name="script_a")
            with open(os.path.join(parent, "script_a", "config.pbtxt")) as f:
                self.assertIn('name: "script_a"', f.read())


if __name__ == "__main__":
    unittest.main()
