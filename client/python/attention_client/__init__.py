"""Python client of the attention service (docs/python.md).

    from attention_client import Client
    with Client("127.0.0.1:50051") as client:
        answer = client.attend(q, k, v, num_heads=4, causal="bottom_right")
        answer.output  # numpy array or torch tensor, as q

attention_client.aio.Client: the same for asyncio. attention_client.torch:
RemoteMultiheadAttention, a drop-in torch.nn.MultiheadAttention, and
export_model.
"""
from attention_client._client import Client, Session
from attention_client._errors import AttentionError
from attention_client._wire import Answer

__all__ = ["Answer", "AttentionError", "Client", "Session"]
