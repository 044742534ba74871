// Builds the prebuilt JupyterLab 4 extension with webpack's ModuleFederationPlugin alone: every JupyterLab and
// Lumino package is taken from JupyterLab's share scope at run time (import: false), so none is needed here.
const path = require('path');
const { ModuleFederationPlugin } = require('webpack').container;

// the major versions JupyterLab 4.0 to 4.6 share (its own packages 4, services 7, coreutils 6, Lumino 2)
const shared = {};
const versions = {
  '@jupyterlab/application': '^4.0.0', '@jupyterlab/apputils': '^4.0.0', '@jupyterlab/notebook': '^4.0.0', '@jupyterlab/statusbar': '^4.0.0',
  '@jupyterlab/services': '^7.0.0', '@jupyterlab/coreutils': '^6.0.0', '@lumino/signaling': '^2.0.0',
  '@lumino/widgets': '^2.0.0',
  '@jupyterlab/running': '^4.0.0', '@jupyterlab/settingregistry': '^4.0.0', '@jupyterlab/ui-components': '^4.0.0',
};
for (const [name, requiredVersion] of Object.entries(versions)) {
  shared[name] = { singleton: true, import: false, requiredVersion };
}

module.exports = {
  mode: 'production',
  entry: {},
  context: __dirname,
  output: {
    path: path.resolve(process.env.GPUCLEANUP_LAB_OUT || path.join(__dirname, 'build')),
    filename: '[name].[contenthash].js',
    publicPath: 'auto',
    clean: true,
  },
  optimization: { minimize: false, chunkIds: 'deterministic', moduleIds: 'deterministic' },
  plugins: [
    new ModuleFederationPlugin({
      name: 'gpucleanup',
      library: { type: 'var', name: ['_JUPYTERLAB', 'gpucleanup'] },
      filename: 'remoteEntry.[contenthash].js',
      exposes: { './index': './src/index.js', './extension': './src/index.js' },
      shared,
    }),
  ],
};
