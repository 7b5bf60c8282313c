"""kuberl_client: connect a simulator to a kuberl actor over `Actor.EnvSession` (gRPC bidi stream).

`EnvSessionClient` speaks the protocol for any simulator loop; `serve_gym_env` (kuberl_client.gym)
drives a gymnasium env with it. gymnasium is imported only when `serve_gym_env` is first used, so
the client itself needs just numpy, grpc and the protocol stubs.
"""

from kuberl_client.session import Box, Discrete, EnvSessionClient, MultiDiscrete, SessionError, SessionTimeout

__all__ = ["Box", "Discrete", "EnvSessionClient", "MultiDiscrete", "SessionError", "SessionTimeout",
           "serve_gym_env"]


def __getattr__(name: str):
    if name == "serve_gym_env":
        from kuberl_client.gym import serve_gym_env
        return serve_gym_env
    raise AttributeError(f"module 'kuberl_client' has no attribute {name!r}")
