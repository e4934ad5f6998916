"""Operations on sinks and pipelines: status and recovery, named snapshots, backups."""
