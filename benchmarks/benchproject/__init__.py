"""The example project plus benchmark-only URLs: a bare view and the same view protected."""
