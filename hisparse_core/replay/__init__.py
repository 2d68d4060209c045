"""The built-in replay engine behind `hisparse bench` and `hisparse run`."""
