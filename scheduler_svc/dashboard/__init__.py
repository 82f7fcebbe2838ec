"""The scheduler's live dashboard: a static page that polls /dashboard/api/state."""
