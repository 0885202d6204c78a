"""Model families (installed as ``parallel3d.models``). They import nothing from parallel3d."""
