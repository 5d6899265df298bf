/** How the panel, the indicator and the tabs write a job's facts. */

import { IJob } from './api';

/** "7 s", "4 min 05 s", "2 h 03 min". */
export function elapsed(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) {
    return `${s} s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, '0')} s`;
  }
  return `${Math.floor(s / 3600)} h ${String(Math.floor(s / 60) % 60).padStart(2, '0')} min`;
}

/** "job 3f2a9c1b", "session 1a2b3c4d", "cell 9e8d7c6b". */
export function title(job: IJob): string {
  return `${job.kind} ${job.id}`;
}

/** Where the job came from: its notebook's name, else its kernel, else its supervisor. */
export function origin(job: IJob): string {
  if (job.notebook) {
    return job.notebook.split('/').pop() || job.notebook;
  }
  if (job.kernel_id) {
    return `kernel ${job.kernel_id.slice(0, 8)}`;
  }
  return `supervisor ${job.supervisor_pid}`;
}

/** One of a few colours a state is drawn in (CSS: `enb-panel-s-<tone>`). */
export function tone(state: string): 'active' | 'ok' | 'bad' | 'ended' {
  switch (state) {
    case 'succeeded':
    case 'done':
      return 'ok';
    case 'failed':
    case 'timeout':
    case 'zombie':
      return 'bad';
    case 'stopped':
    case 'stopping':
    case 'interrupted':
    case 'killed':
      return 'ended';
    default:
      return 'active';
  }
}

/** ANSI colour codes out (a log tab draws plain text). */
export function plain(text: string): string {
  // eslint-disable-next-line no-control-regex
  return text.replace(/\x1b\[[0-9;?]*[A-Za-z]/g, '');
}

/** The first line of a text, for one-line views of multi-line alerts. */
export function firstLine(text: string): string {
  const i = text.indexOf('\n');
  return i < 0 ? text : text.slice(0, i);
}
