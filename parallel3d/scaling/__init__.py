"""`parallel3d scaling`: the scaling curve of a recipe, measured and extended."""
