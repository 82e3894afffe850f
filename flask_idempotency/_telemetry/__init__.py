"""Telemetry: OpenTelemetry metrics, spans and trace context, all optional.

Nothing of ``opentelemetry`` is imported unless the ``otel`` extra is installed,
and then only when first used.
"""
