"""specserve: distributed speculative decoding on Ray that never changes an output token.

Rooms (each folder of the repository is one subpackage, see pyproject.toml):

    specserve.core        shared by both processes: model runner, KV cache, lean Llama forward,
                          sampling / warping / random streams, the Proposer interface
    specserve.proto       the wire contract (speculative.proto), its stubs and codec
    specserve.drafter     the drafter process: draft-model proposer, pipelining, gRPC server, actor
    specserve.verifier    the verifier process: acceptance rule, engine loop, gRPC client, actor
    specserve.cluster     Ray wiring and the HTTP app: pairs on Ray, the Serve app, OpenAI protocol
    specserve.training    training and evaluation (not in the serving images)
    specserve.benchmarks  benchmarks (not in the serving images)

`specserve.config` holds the one config object and `specserve.builder` the one way to build a
pair from it; `specserve.cli` is the command line.
"""

__version__ = "0.1.0"
