/**
 * elastic-nb's JupyterLab extension: control of %%elastic jobs that never goes through the
 * kernel. A blocking cell keeps its kernel busy, and a busy kernel does not hear widget clicks
 * (ipykernel 7.4), so the panel, the commands and the indicator talk to the Jupyter server's
 * `elastic-nb/api`, which talks to the supervisors.
 */

import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';

import { JobActions } from './actions';
import { CommandIds, addCommands } from './commands';
import { IndicatorExtension } from './indicator';
import { JobsModel } from './jobs';
import { JobsPanel } from './panel';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'elastic-nb:plugin',
  description: 'The Elastic jobs panel, its commands and the notebook toolbar indicator.',
  autoStart: true,
  requires: [ICommandPalette, INotebookTracker],
  optional: [ILayoutRestorer],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette,
    tracker: INotebookTracker,
    restorer: ILayoutRestorer | null
  ) => {
    const model = new JobsModel();
    const actions = new JobActions(app, model);
    const panel = new JobsPanel(model, actions);
    app.shell.add(panel, 'left', { rank: 250 });
    restorer?.add(panel, panel.id);
    addCommands(app, palette, tracker, actions, panel.id);
    app.docRegistry.addWidgetExtension(
      'Notebook',
      new IndicatorExtension(model, () => void app.commands.execute(CommandIds.showPanel))
    );
  }
};

export default plugin;
