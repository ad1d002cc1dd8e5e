# Autouse in this folder only: pin torch to one thread for every test here.
from tests.torch_threads import single_torch_thread  # noqa: F401
