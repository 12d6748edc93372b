"""Import-only stand-in for torchaudio, used ONLY on the integration-test path when the real
package is missing (ComfyUI 0.33 imports it at start-up; there is no wheel for every torch).
Never shipped: any real use raises."""
__version__ = "0.0.0+levers-test-stub"


def __getattr__(name):
    raise RuntimeError(f"torchaudio.{name}: this is the Levers test stand-in; audio is not available in tests")
