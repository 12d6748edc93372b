"""The only code that touches ComfyUI internals. Modules here import ``comfy`` lazily and detect
features (not versions), so the pack works from ComfyUI 0.3.64 to the DynamicVRAM releases."""
