package pyspark_txn_test;

import org.apache.hadoop.mapreduce.JobContext;
import org.apache.hadoop.mapreduce.OutputCommitter;
import org.apache.hadoop.mapreduce.TaskAttemptContext;

/**
 * A committer whose tasks write straight into the output folder and whose abort
 * removes nothing: what Databricks' transactional commit protocol (DBIO) and a failed
 * Hadoop v2 task commit leave behind, a failed attempt's files next to the committed
 * ones. Spark writes into the output folder directly for any committer that is not a
 * FileOutputCommitter. Like DBIO's, its file names differ per task attempt (Spark
 * takes the prefix from mapreduce.output.basename), so a retry does not overwrite them.
 */
public class LeakyCommitter extends OutputCommitter {
  public LeakyCommitter() {}
  @Override public void setupJob(JobContext job) {}
  @Override public void setupTask(TaskAttemptContext task) {
    task.getConfiguration().set(
        "mapreduce.output.basename", "part-a" + task.getTaskAttemptID().getId());
  }
  @Override public boolean needsTaskCommit(TaskAttemptContext task) { return false; }
  @Override public void commitTask(TaskAttemptContext task) {}
  @Override public void abortTask(TaskAttemptContext task) {}
}
